"""Latency of one batch, like ``vllm bench latency``, and the decode step against the floor.

Each iteration sends ``--batch-size`` new requests (``--input-len`` random words,
``--num-images`` noise images of ``--image-size``; fresh each time, so no cache hits) to
``LLM.generate``, each forced to ``--output-len`` tokens, and times the call. After
``--num-iters-warmup`` untimed iterations, ``--num-iters`` give mean, median, p90, p99 (s).

The same with one output token: the medians' difference over ``output_len - 1`` is the decode
step time. On CUDA it is compared with two floors at the measured copy bandwidth: all weights
(tower and embedding included, a tied head once), and the LM weights one step reads (no tower,
``batch`` embedding rows, the head once).

    python -m mm_serve.benchmarks.latency --model-arch qwen2-vl-2b --batch-size 1 \
        --output-json latency.json"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from typing import Any

import numpy as np
import torch

from mm_serve.benchmarks import common
from mm_serve.benchmarks.datasets import random_image_dataset
from mm_serve.benchmarks.roofline import copy_rate
from mm_serve.models.loader import build_empty_model, get_model_class

logger = logging.getLogger(__name__)

# Parameter name prefixes of vision towers and projectors (Qwen2-VL, LLaVA).
VISION_PREFIXES = ("visual.", "vision_tower.", "multi_modal_projector.")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mm-serve bench latency``."""
    common.add_model_args(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--batch-size", type=int, default=1, help="Requests per iteration.")
    group.add_argument("--input-len", type=int, default=50, help="Random words per prompt.")
    group.add_argument("--output-len", type=int, default=128, help="Output tokens per request.")
    common.add_image_args(parser)
    group.add_argument("--no-image", action="store_true", help="Text only (--num-images 0).")
    group.add_argument("--num-iters", type=int, default=10, help="Timed iterations.")
    group.add_argument("--num-iters-warmup", type=int, default=3, help="Untimed iterations.")
    group.add_argument("--output-json", help="Write the full results here.")


def weight_bytes(model: torch.nn.Module, lm_only: bool = False) -> int:
    """Bytes of the model's parameters, each tensor once (a tied LM head is the embedding).
    ``lm_only``: without the vision tower and the token embedding (the LM head counted)."""
    seen, total = set(), 0
    # Duplicates included: with lm_only, a tied matrix is skipped as ``embed_tokens`` and then
    # counted as ``lm_head``.
    for name, param in model.named_parameters(remove_duplicate=False):
        skip = lm_only and (name.startswith(VISION_PREFIXES) or "embed_tokens" in name)
        if skip or id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel() * param.element_size()
    return total


def time_iterations(llm, args: argparse.Namespace, output_len: int, seed: int) -> list[float]:
    """Seconds of each timed ``generate`` of one batch (fresh requests each iteration).

    Raises ``RuntimeError`` if a request did not give exactly ``output_len`` tokens.
    """
    from mm_serve import SamplingParams

    num_images = 0 if args.no_image else args.num_images
    iters = args.num_iters_warmup + args.num_iters
    requests = random_image_dataset(
        args.batch_size * iters, args.input_len, output_len, tuple(args.image_size),
        num_images, seed,
    )  # fmt: skip
    model_type = llm.config.model.hf_config.model_type
    prompts = common.image_prompts(requests, model_type)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    times = []
    for i in range(iters):
        batch = prompts[i * args.batch_size : (i + 1) * args.batch_size]
        common.sync()
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        common.sync()
        if i >= args.num_iters_warmup:
            times.append(time.perf_counter() - start)
        lengths = {len(o.outputs[0].token_ids) for o in outputs}
        if lengths != {output_len}:
            raise RuntimeError(f"bench latency: output lengths {lengths} != {output_len}")
    return times


def summarize(times: list[float]) -> dict[str, float]:
    """Mean, median, p90, p99 (seconds) of the timed iterations."""
    values = np.asarray(times)
    return {
        "mean_s": float(values.mean()),
        "median_s": float(np.median(values)),
        "p90_s": float(np.percentile(values, 90)),
        "p99_s": float(np.percentile(values, 99)),
        "latencies_s": [float(t) for t in times],
    }


def decode_floors(all_bytes: int, lm_bytes: int, device: torch.device) -> dict[str, Any]:
    """The weight bytes and, on CUDA, the copy bandwidth and the two weight-read floors (ms).
    Call it with the engine gone: the copy needs 2 GiB of free device memory."""
    bandwidth = copy_rate(device) if device.type == "cuda" else None
    return {
        "all_weight_bytes": all_bytes,
        "lm_weight_bytes": lm_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "floor_all_weights_ms": all_bytes / bandwidth * 1e3 if bandwidth else None,
        "floor_lm_weights_ms": lm_bytes / bandwidth * 1e3 if bandwidth else None,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the results (also written to ``--output-json``)."""
    from mm_serve import LLM

    with tempfile.TemporaryDirectory(prefix="mm-serve-bench-") as workdir:
        folder, load_format = common.model_folder(args, workdir)
        llm = LLM(folder, **common.engine_kwargs(args, load_format))
        try:
            full = summarize(time_iterations(llm, args, args.output_len, args.seed))
            one = summarize(time_iterations(llm, args, 1, args.seed + 1))
            config = llm.config
            # The parameters' shapes on the meta device: the engine core may be another process.
            model = build_empty_model(
                get_model_class(llm.config.model.hf_config), llm.config.model, "meta"
            )
            all_bytes, lm_bytes = weight_bytes(model), weight_bytes(model, lm_only=True)
            del model
        finally:
            common.shutdown(llm)
    floors = decode_floors(all_bytes, lm_bytes, config.device)
    result = {
        **common.result_header(args, load_format, config, _workload(args)),
        "latency": full,
        "latency_output_len_1": one,
        **floors,
    }
    _add_decode_step(result, args.output_len)
    print_summary(result)
    common.write_json(args.output_json, result)
    return result


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "batch_size": args.batch_size,
        **common.image_workload(args, args.no_image),
        "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
    }


def _add_decode_step(result: dict[str, Any], output_len: int) -> None:
    """decode step (ms) = (median at output_len - median at 1) / (output_len - 1), and its
    ratio to each floor."""
    result["decode_step_ms"] = None
    if output_len > 1:
        diff = result["latency"]["median_s"] - result["latency_output_len_1"]["median_s"]
        result["decode_step_ms"] = diff / (output_len - 1) * 1e3
    step = result["decode_step_ms"]
    for name in ("all_weights", "lm_weights"):
        floor = result[f"floor_{name}_ms"]
        known = floor is not None and step is not None
        result[f"decode_step_over_floor_{name}"] = step / floor if known else None


def print_summary(result: dict[str, Any]) -> None:
    """The short table, last on stdout."""
    w = result["workload"]
    images = (
        f"{w['num_images']} x {w['image_size'][0]}x{w['image_size'][1]}"
        if w["num_images"]
        else "no"
    )
    print(f"\n{result['model']} ({result['load_format']} weights, {result['dtype']}) on "
          f"{result['device']}: batch {w['batch_size']}, {w['input_len_words']} words + "
          f"{images} image(s) -> {w['output_len']} tokens, {w['num_iters']} iters")  # fmt: skip
    print(f"{'e2e latency (s)':<24} {'mean':>9} {'median':>9} {'p90':>9} {'p99':>9}")
    for key, label in (
        ("latency", f"output {w['output_len']}"),
        ("latency_output_len_1", "output 1"),
    ):
        r = result[key]
        print(f"{label:<24} {r['mean_s']:>9.4f} {r['median_s']:>9.4f} {r['p90_s']:>9.4f} "
              f"{r['p99_s']:>9.4f}")  # fmt: skip
    step = result["decode_step_ms"]
    print(f"decode step: {step:.3f} ms" if step is not None else "decode step: n/a (output 1)")
    gb = 1e9
    print(f"weights: all {result['all_weight_bytes'] / gb:.2f} GB, "
          f"LM {result['lm_weight_bytes'] / gb:.2f} GB")  # fmt: skip
    bandwidth = result["copy_bandwidth_bytes_per_s"]
    if bandwidth is None:
        print("floors: skipped (no device copy bandwidth on CPU)")
        return
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    for name, label in (("all_weights", "all weights"), ("lm_weights", "LM weights")):
        ratio = result[f"decode_step_over_floor_{name}"]
        shown = f"{ratio:.2f}x" if ratio is not None else "n/a"
        print(f"floor ({label}): {result[f'floor_{name}_ms']:.3f} ms; decode step / floor {shown}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args())
