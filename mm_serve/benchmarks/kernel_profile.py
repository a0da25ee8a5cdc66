"""The device kernels of one ``bench throughput`` workload, largest first, under the torch
profiler (the engine core in-process, so that the profiler sees its kernels).

    python -m mm_serve.benchmarks.kernel_profile --model-arch qwen2.5-vl-7b --num-prompts 128 \\
        --input-len 7 --output-len 32 --image-size 1280 720 --max-model-len 4096

Prints the wall time of the profiled ``generate``, the sum of kernel times, and the top
kernels (device ms and share of the kernel sum), each once per name.
"""

from __future__ import annotations

import tempfile
import time

from torch.profiler import ProfilerActivity, profile

from mm_serve.benchmarks import common
from mm_serve.benchmarks.datasets import random_image_dataset


def main() -> None:
    parser = common.profile_parser(__doc__, output_len=128)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    from mm_serve import SamplingParams

    with tempfile.TemporaryDirectory() as workdir:
        llm = common.in_process_llm(args, workdir)
        model_type = llm.config.model.hf_config.model_type

        def prompts(seed: int, n: int):
            requests = random_image_dataset(
                n,
                args.input_len,
                args.output_len,
                tuple(args.image_size),
                seed=seed,
                num_images=args.num_images,
            )
            return common.image_prompts(requests, model_type)

        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts(100, 8), params, use_tqdm=False)
        batch = prompts(1, args.num_prompts)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        common.shutdown(llm)
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"wall {wall * 1e3:.0f} ms (profiled), kernel sum {total_ms:.0f} ms")
    for e in kernels[: args.top]:
        ms = e.self_device_time_total / 1e3
        print(f"{ms:9.1f} ms {100 * ms / total_ms:5.1f}% {e.count:7d}  {e.key[:110]}")


if __name__ == "__main__":
    main()
