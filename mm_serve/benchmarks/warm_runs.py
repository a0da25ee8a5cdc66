"""The image workload several times on one engine: does the first batch after start-up run as
fast as the next ones?

``bench throughput`` times the first large batch an engine meets after start-up (and four
warm-up requests); whatever an engine does once per new shape (a cuDNN plan, a Triton compile,
a CUDA graph capture, a pinned buffer that grows) lands in that run. This script builds one
engine (its own process, as ``LLM`` runs it), sends the same four warm-up requests, then
``--runs`` batches of ``--num-prompts`` requests, each with other random images and words (no
prefix-cache hit), and prints each run's seconds and output tok/s. With
``MM_SERVE_STEP_TIMELINE=<file>`` each run's steps are recorded; ``python -m
mm_serve.benchmarks.step_timeline <file> --run N`` shows run ``N`` (0: start-up's warm-up,
1: the four requests, 2: the first batch), and each run's line adds the front end's share: the
ms from the call to the first step and from the last step to the call's return.
``--profile-run N`` records run ``N`` with the torch
profiler in the engine's processes (``mm_serve.profiler``); ``python -m
mm_serve.benchmarks.trace_gaps`` reads the traces.

    python -m mm_serve.benchmarks.warm_runs --model-arch qwen2-vl-2b --image-size 448 448 \\
        --max-model-len 4096 --runs 3
"""

from __future__ import annotations

import functools
import os
import tempfile
import time

from mm_serve.benchmarks import common
from mm_serve.benchmarks.step_timeline import load_runs
from mm_serve.engine.step_timeline import ENV as TIMELINE_ENV


def main() -> None:
    parser = common.profile_parser(__doc__, output_len=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--profile-run",
        type=int,
        help="Profile this run in the engine's processes (LLM.start_profile; set "
        "MM_SERVE_TORCH_PROFILER_DIR, and MM_SERVE_TORCH_PROFILER_ACTIVITIES=cuda for the "
        "device alone). Its time then includes the profiler's.",
    )
    args = parser.parse_args()
    from mm_serve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as workdir:
        folder, load_format = common.model_folder(args, workdir)
        llm = LLM(folder, **common.engine_kwargs(args, load_format))
        model_type = llm.config.model.hf_config.model_type
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

        prompts = functools.partial(common.profile_prompts, args, model_type)
        llm.generate(prompts(100, 4), params, use_tqdm=False)
        print("warm-up done: 4 requests", flush=True)  # run_gpu.sh first-batch-stacks waits
        for run in range(1, args.runs + 1):
            batch = prompts(run, args.num_prompts)
            if run == args.profile_run:
                llm.start_profile()
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            end = time.perf_counter()
            if run == args.profile_run:
                llm.stop_profile()
            tok_s = args.num_prompts * args.output_len / (end - start)
            print(f"run {run}: {end - start:.3f} s, {tok_s:,.0f} output tok/s{_ends(start, end)}")
        common.shutdown(llm)


def _ends(start: float, end: float) -> str:
    """With a step timeline (recorded on CUDA only): ms from ``start`` (``time.perf_counter``,
    one clock for every process) to the last run's first step, and from its last step to
    ``end``."""
    path = os.environ.get(TIMELINE_ENV)
    if not path or not os.path.exists(path):
        return ""
    steps = load_runs(path)[-1]
    before, after = steps[0]["t0"] - start, end - steps[-1]["t1"]
    return f" (front end: {before * 1e3:.1f} ms to the first step, {after * 1e3:.1f} ms after)"


if __name__ == "__main__":
    main()
