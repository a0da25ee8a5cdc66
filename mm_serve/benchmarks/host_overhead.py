"""The engine core's host work per decode step, with the model's device work taken out.

The engine core's Python per step (scheduler, batch update, input preparation, sampling
metadata, stop checks, ``OutputCodec.encode``) sets the step's length once it exceeds the
device's time. This measures it alone, on any machine: the tiny Qwen2-VL architecture on the CPU
with its LM forward replaced by a zero hidden state and its logits by a fixed random
``[num_tokens, --vocab]`` block; everything else is the engine's code in ``EngineCore.step``'s
async order. Apart: the front end's part (decoding the message, ``process_outputs``).

    mm-serve bench host-overhead --batch-sizes 1 64 256
    mm-serve bench host-overhead --image-size 56 56  # each prompt with an image

With ``--image-size`` each request is 18 random words and one noise image; without, 50 random
token ids. Prints, per batch size, the engine core's median ms per step and us per request per
step, and the front end's median ms per step; ``--profile`` adds the cProfile top rows of the
engine core's steps at the largest batch."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

import torch

from mm_serve import LLM
from mm_serve.benchmarks import common
from mm_serve.benchmarks.architectures import write_architecture
from mm_serve.benchmarks.datasets import random_image_dataset
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.messages.wire import EngineCoreOutputs, OutputCodec


def host_only_engine(max_num_seqs: int, vocab: int):
    """The tiny Qwen2-VL ``LLM`` on the CPU, its engine core in the process, its LM forward
    and logits replaced."""
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
    common.as_engine_core_process()
    return llm


def add_requests(llm, batch_size: int, params, prefix: str, image_size) -> list[str]:
    """Add ``batch_size`` requests to ``llm``'s engine core: 50 random token ids below the
    special ids, or, with ``image_size``, 18 random words and one noise image each."""
    if image_size is None:
        gen = torch.Generator().manual_seed(batch_size)
        prompts = [
            {"prompt_token_ids": torch.randint(0, 400, (50,), generator=gen).tolist()}
            for _ in range(batch_size)
        ]
    else:
        requests = random_image_dataset(batch_size, 18, 1, tuple(image_size), seed=batch_size)
        prompts = common.image_prompts(requests, llm.config.model.hf_config.model_type)
    processed = [llm.input_processor.process(prompt) for prompt in prompts]
    engine_requests = []
    for i, pending in enumerate(processed):  # tracked by the output processor too
        engine_requests += llm.make_requests(f"{prefix}{i}", pending.result(), params, False)[1]
    llm.engine_core.add_requests(engine_requests)
    return [request.request_id for request in engine_requests]


def step_times(
    llm, batch_size: int, steps: int, prefix: str, image_size=None
) -> tuple[list[float], list[float]]:
    """Add ``batch_size`` requests (``add_requests``), run them to decode, then time ``steps``
    decode steps: the engine core's ms per step, and the front end's (decode the step's
    message, process its outputs).

    Raises:
        RuntimeError: a timed step did not give one new token to every request, or the front
            end did not take them all.
    """
    core, output_processor = llm.engine_core, llm.output_processor
    params = SamplingParams(temperature=0.0, max_tokens=steps + 32, ignore_eos=True)
    request_ids = add_requests(llm, batch_size, params, prefix, image_size)
    while any(r.num_output_tokens < 4 for r in core.scheduler.requests.values()):
        output_processor.process_outputs(core.step())  # prompts (and images), a few decodes
    codec, engine_times, front_end_times = OutputCodec(), [], []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = core.step()
        if sorted(len(o.new_token_ids) for o in outputs) != [1] * batch_size:
            raise RuntimeError(f"A decode step gave {len(outputs)} outputs for {batch_size}.")
        message = codec.encode(EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic()))
        received = time.perf_counter()
        output_processor.process_outputs(codec.decode(message).outputs)
        engine_times.append((received - start) * 1e3)
        front_end_times.append((time.perf_counter() - received) * 1e3)
    taken = [len(output_processor.states[i].token_ids) for i in request_ids]
    if min(taken) < steps + 4:
        raise RuntimeError(f"The front end took {min(taken)} tokens of a request, not {steps + 4}.")
    core.abort_requests(request_ids)
    output_processor.abort_requests(request_ids)
    while core.has_unfinished_requests():
        core.step()
    return engine_times, front_end_times


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mm-serve bench host-overhead``."""
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=1024, help="Width of the fixed logits.")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--image-size", type=int, nargs=2, metavar=("WIDTH", "HEIGHT"))


def main(args: argparse.Namespace) -> list[dict[str, float]]:
    """Time the steps at each batch size and print the table; returns its rows."""
    llm = host_only_engine(max(args.batch_sizes), args.vocab)
    print("batch | ms per step (median) | us per request per step | front end ms per step")
    rows = []
    for batch_size in args.batch_sizes:
        times, front_end = step_times(
            llm, batch_size, args.steps, f"b{batch_size}-", args.image_size
        )
        median = statistics.median(times)
        print(
            f"{batch_size:5d} | {median:8.3f} | {median * 1e3 / batch_size:8.1f} | "
            f"{statistics.median(front_end):8.3f}"
        )
        rows.append(
            {
                "batch_size": batch_size,
                "step_ms": median,
                "front_end_ms": statistics.median(front_end),
            }
        )
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        step_times(llm, max(args.batch_sizes), args.steps, "profile-", args.image_size)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    llm.shutdown()
    return rows
