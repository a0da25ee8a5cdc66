"""Where one request's time to first token goes: preprocessing, then the engine's steps.

For ``--num-iters`` fresh requests (``--input-len`` random words + one noise image of
``--image-size``, one output token), each alone:

- ``preprocess``: ``InputProcessor.process`` then ``result()``: tokenization, the image's round
  trip through the preprocessing pool, placeholder expansion;
- ``engine``: from adding the request to the engine core until a step returns its token (the
  vision tower, the prefill, sampling; with async scheduling two ``step()`` calls);
- ``generate``: the whole ``LLM.generate`` call, as ``bench latency --output-len 1`` times it;
- ``preprocess_compute``: the image processor's own work on one image in this process (what a
  worker computes; ``preprocess`` minus this is transport: pickling, pipes, queues);
- ``tower``: the vision tower alone on one preprocessed image, host time to launch it and
  device time (CUDA events), as ``image_profile`` times 32.

Medians in milliseconds, after ``--num-iters-warmup`` untimed iterations.

    python -m mm_serve.benchmarks.ttft --model-arch qwen2-vl-2b --output-json ttft.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch

from mm_serve.benchmarks import common
from mm_serve.benchmarks.datasets import random_image_dataset
from mm_serve.benchmarks.image_profile import _time_tower


def _first_token_ms(llm, prompt, params) -> tuple[float, float]:
    """(preprocess ms, engine ms) of one request alone, synchronised at both ends."""
    common.sync()
    t0 = time.perf_counter()
    processed = llm.input_processor.process(prompt).result()
    t1 = time.perf_counter()
    added: list[str] = []
    llm._add_request(processed, params, added)
    outputs: list = []
    while not outputs:
        outputs = llm.engine_core.step()
    common.sync()
    t2 = time.perf_counter()
    while llm.engine_core.has_unfinished_requests():  # the async step in flight, if any
        llm.engine_core.step()
    llm.output_processor.abort_requests(added)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def _preprocess_ms(processor, image, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        processor.preprocess(image, defer_normalization=True)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The measurements above on a fresh engine; returns the medians (ms)."""
    from mm_serve import SamplingParams
    from mm_serve.encoders.processors import get_image_processor

    with tempfile.TemporaryDirectory() as workdir:
        llm = common.in_process_llm(args, workdir)
        model_type = llm.config.model.hf_config.model_type
        iters = args.num_iters_warmup + args.num_iters
        requests = random_image_dataset(iters, args.input_len, 1, tuple(args.image_size), seed=9)
        prompts = common.image_prompts(requests, model_type)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        phases: dict[str, list[float]] = {"preprocess": [], "engine": [], "generate": []}
        fresh = random_image_dataset(iters, args.input_len, 1, tuple(args.image_size), seed=10)
        fresh_prompts = common.image_prompts(fresh, model_type)
        for i in range(iters):
            pre, engine = _first_token_ms(llm, prompts[i], params)
            common.sync()
            t0 = time.perf_counter()
            llm.generate(fresh_prompts[i], params, use_tqdm=False)
            generate = (time.perf_counter() - t0) * 1e3
            if i >= args.num_iters_warmup:
                for name, ms in zip(phases, (pre, engine, generate), strict=True):
                    phases[name].append(ms)
        result = {name: statistics.median(values) for name, values in phases.items()}
        if torch.cuda.is_available():
            config = llm.config.model
            processor = get_image_processor(config.path, config.hf_config)
            image = processor.preprocess(requests[0].images[0])
            result["preprocess_compute"] = _preprocess_ms(processor, requests[0].images[0])
            tower = _time_tower(llm.engine_core.model_runner.model, [image], flops=1.0)
            result.update(tower_host_ms=tower["host_ms"], tower_device_ms=tower["device_ms"])
        common.shutdown(llm)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_args(parser)
    parser.add_argument("--input-len", type=int, default=18, help="Random words (~50 tokens).")
    parser.add_argument("--image-size", type=int, nargs=2, default=[448, 448])
    parser.add_argument("--num-iters", type=int, default=20)
    parser.add_argument("--num-iters-warmup", type=int, default=5)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    result = run(args)
    common.write_json(args.output_json, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
