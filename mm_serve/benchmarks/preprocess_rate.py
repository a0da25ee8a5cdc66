"""How fast the offline front end readies image prompts for the engine, the engine left out.

``LLM.generate`` hands each prompt to its input processor (tokenize, hash the image, the
preprocessing pool's round trip) at most ``SUBMIT_WINDOW`` ahead of the engine, and adds it
once it is ready. At the start of a batch the engine steps on whatever has arrived, so the
first encode steps hold a few images each (BENCHMARKS.md, twenty-first session). This script
times that supply alone: ``--num-prompts`` prompts of the workload flags (workload 1's by
default) through the front end of ``--model-arch`` (its config, tokenizer and processor; no
model is built), at most ``--window`` in flight, as ``LLM._run_engine`` keeps them.

    python -m mm_serve.benchmarks.preprocess_rate [--mm-preprocess-workers 8] [--profile]

Prints when the 26th prompt (one encode step of workload 1) and the last were ready, and the
ms per prompt; ``--profile`` adds the cProfile table of the calling thread (tottime).
"""

from __future__ import annotations

import collections
import cProfile
import pstats
import tempfile
import time

from mm_serve.benchmarks import common
from mm_serve.config import EngineArgs
from mm_serve.entrypoints.llm import SUBMIT_WINDOW
from mm_serve.frontend.base import FrontEnd


def ready_times(input_processor, prompts: list, window: int) -> list[float]:
    """Seconds from the start until each prompt was ready, ``window`` submitted ahead.

    Raises whatever a prompt's ``result()`` raises (a malformed prompt or image)."""
    start, pending, ready = time.perf_counter(), collections.deque(), []
    submitted = 0
    while len(ready) < len(prompts):
        while submitted < len(prompts) and len(pending) < window:
            pending.append(input_processor.process(prompts[submitted]))
            submitted += 1
        pending.popleft().result()
        ready.append(time.perf_counter() - start)
    return ready


def main() -> None:
    parser = common.profile_parser(__doc__, output_len=1)
    parser.add_argument("--window", type=int, default=SUBMIT_WINDOW)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    folder, load_format = common.model_folder(args, tempfile.mkdtemp())
    front_end = FrontEnd(EngineArgs(model=folder, **common.engine_kwargs(args, load_format)))
    processor, model_type = front_end.input_processor, front_end.config.model.hf_config.model_type
    profiler = cProfile.Profile()
    try:
        ready_times(processor, common.profile_prompts(args, model_type, 2, 16), args.window)
        prompts = common.profile_prompts(args, model_type, 1, args.num_prompts)
        if args.profile:
            profiler.enable()
        ready = ready_times(processor, prompts, args.window)
        profiler.disable()
    finally:
        processor.shutdown()
    print(
        f"{len(ready)} prompts, {front_end.config.multimodal.mm_preprocess_workers} workers, "
        f"window {args.window}: 26th ready at {ready[min(25, len(ready) - 1)] * 1e3:.1f} ms, "
        f"all at {ready[-1] * 1e3:.1f} ms ({ready[-1] * 1e3 / len(ready):.2f} ms per prompt)"
    )
    if args.profile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
