"""The engine core's host work per decode step, with the model's device work taken out.

A decode step's device work (one CUDA graph replay, logits, sampling) is a few ms at batch 256;
the engine core's own Python (scheduler, batch update, input preparation, sampling metadata,
stop checks, the outputs' wire form and encoding) runs for every request every step and, once
it exceeds the device's time, sets the step's length even with async scheduling. This script
measures that Python alone, on any machine: the tiny Qwen2-VL architecture runs in the process
on the CPU with its LM forward replaced by a zero hidden state and its logits by a fixed random
``[num_tokens, --vocab]`` block (greedy sampling then picks varying tokens). Everything else is
the engine's own code, in ``EngineCore.step``'s async order, plus what the engine core
process adds per step (``output_to_wire`` and ``OutputCodec.encode``).

    python -m mm_serve.benchmarks.host_overhead --batch-sizes 1 64 256

Prints, per batch size, the median ms per step and us per request per step; ``--profile``
adds the cProfile table of the largest batch (its tottime column, the top rows).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

import torch

from mm_serve import LLM
from mm_serve.benchmarks.architectures import write_architecture
from mm_serve.messages import EngineCoreOutputs, OutputCodec, output_to_wire
from mm_serve.request import Request
from mm_serve.sampling_params import SamplingParams


def host_only_engine(max_num_seqs: int, vocab: int):
    """The tiny Qwen2-VL engine core on the CPU, its LM forward and logits replaced."""
    folder = write_architecture("tiny-qwen2-vl", tempfile.mkdtemp())
    llm = LLM(
        folder,
        load_format="dummy",
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        multiprocess=False,
        device="cpu",
    )
    core = llm.engine_core
    runner = core.model_runner
    hidden_size = runner.config.model.text_config.hidden_size
    logits = torch.randn(max_num_seqs * 8, vocab, generator=torch.Generator().manual_seed(0))
    runner._forward = lambda inputs: torch.zeros(len(inputs.input_ids), hidden_size)
    runner.model.compute_logits = lambda hidden: logits[: len(hidden)]
    return llm, core


def step_times(core, batch_size: int, steps: int, prefix: str) -> list[float]:
    """Add ``batch_size`` requests, run to decode, then time ``steps`` decode steps (ms).

    Raises:
        RuntimeError: a timed step did not give one new token to every request.
    """
    params = SamplingParams(temperature=0.0, max_tokens=steps + 32, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch_size)
    for i in range(batch_size):
        ids = torch.randint(0, 400, (50,), generator=gen).tolist()  # below the special ids
        core.add_request(Request(f"{prefix}{i}", ids, params))
    for _ in range(8):  # the prompts, then a few decode steps
        core.step()
    codec, times = OutputCodec(), []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = core.step()
        if sorted(len(o.new_token_ids) for o in outputs) != [1] * batch_size:
            raise RuntimeError(f"A decode step gave {len(outputs)} outputs for {batch_size}.")
        wire = [output_to_wire(o) for o in outputs]
        codec.encode(EngineCoreOutputs(outputs=wire, timestamp=time.monotonic()))
        times.append((time.perf_counter() - start) * 1e3)
    core.abort_requests([f"{prefix}{i}" for i in range(batch_size)])
    while core.has_unfinished_requests():
        core.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=1024, help="Width of the fixed logits.")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm, core = host_only_engine(max(args.batch_sizes), args.vocab)
    print("batch | ms per step (median) | us per request per step")
    for batch_size in args.batch_sizes:
        median = statistics.median(step_times(core, batch_size, args.steps, f"b{batch_size}-"))
        print(f"{batch_size:5d} | {median:8.3f} | {median * 1e3 / batch_size:8.1f}")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        step_times(core, max(args.batch_sizes), args.steps, "profile-")
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    llm.shutdown()


if __name__ == "__main__":
    main()
