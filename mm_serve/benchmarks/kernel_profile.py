"""The device kernels of one ``bench throughput`` workload, largest first, under the torch
profiler (the engine core in-process, so that the profiler sees its kernels).

    python -m mm_serve.benchmarks.kernel_profile --model-arch qwen2.5-vl-7b --num-prompts 128 \\
        --input-len 7 --output-len 32 --image-size 1280 720 --max-model-len 4096

Prints the wall time of the profiled ``generate``, the sum of kernel times, and the top
kernels (device ms and share of the kernel sum), each once per name. With ``--idle`` the
profiler records device activity only (no host ops, so it adds little host time) and the
script first prints where the device idled: the union of the kernels' and copies' intervals
against the run's span, and the largest gaps with the kernels on either side. There the batch
runs warm (a batch of other images first) and preprocessed before the profile starts, so that
no tokenizing or image preprocessing in this process (the engine core's) shows as idle time.
"""

from __future__ import annotations

import functools
import tempfile
import time

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from mm_serve.benchmarks import common
from mm_serve.benchmarks.trace_gaps import print_gaps


def main() -> None:
    parser = common.profile_parser(__doc__, output_len=128)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--idle", action="store_true", help="Where the device idled.")
    args = parser.parse_args()
    from mm_serve import SamplingParams

    with tempfile.TemporaryDirectory() as workdir:
        llm = common.in_process_llm(args, workdir)
        model_type = llm.config.model.hf_config.model_type

        prompts = functools.partial(common.profile_prompts, args, model_type)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts(100, 8), params, use_tqdm=False)
        if args.idle:
            batch = common.warm_preprocessed_batch(llm, args, params)
        else:
            batch = prompts(1, args.num_prompts)
        activities = [ProfilerActivity.CUDA] + ([] if args.idle else [ProfilerActivity.CPU])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        common.shutdown(llm)
    if args.idle:
        print_idle(prof, wall, args.top)
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"wall {wall * 1e3:.0f} ms (profiled), kernel sum {total_ms:.0f} ms")
    for e in kernels[: args.top]:
        ms = e.self_device_time_total / 1e3
        print(f"{ms:9.1f} ms {100 * ms / total_ms:5.1f}% {e.count:7d}  {e.key[:110]}")


def print_idle(prof, wall: float, top: int) -> None:
    """``trace_gaps.print_gaps`` of the profile's device activities (us)."""
    print(f"wall {wall * 1e3:.0f} ms (profiled)")
    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]
    print_gaps(spans, top)


if __name__ == "__main__":
    main()
