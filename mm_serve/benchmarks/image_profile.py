"""Where the image path's time goes: the throughput workload step by step, and the tower alone.

1. ``steps``: ``bench throughput``'s workload through ``LLM.generate``, every engine step timed
   on the host (synchronised) and classed by what it ran (images encoded, prompt tokens, decode
   rows), so encode/prefill steps are separated from decode steps.
2. ``profile``: the same run under the torch profiler: the top host ops by self CPU time and
   the top device kernels.
3. ``tower``: the vision tower alone on ``--tower-images`` preprocessed images: host time and
   device time (CUDA events) of ``embed_images``, and its achieved TFLOP/s from the tower's
   matmul FLOPs (``tower_flops``).

    python -m mm_serve.benchmarks.image_profile --model-arch qwen2-vl-2b --out bench-out
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch

from mm_serve.benchmarks import common
from mm_serve.benchmarks.datasets import random_image_dataset


def tower_flops(vision_config: Any, num_patches: int, seq_len: int) -> float:
    """Matmul FLOPs of one Qwen2-VL tower forward over ``num_patches`` patches in images of
    ``seq_len`` patches: per block qkv + proj + MLP (2 FLOPs per multiply-add) plus attention
    ``QK^T`` and ``PV`` (``4 * seq_len * dim`` per patch); the merger is left out (< 2%)."""
    dim = vision_config.embed_dim
    hidden = int(dim * getattr(vision_config, "mlp_ratio", 4))
    per_patch = 2 * (3 * dim * dim + dim * dim + 2 * dim * hidden) + 4 * seq_len * dim
    return vision_config.depth * per_patch * num_patches


def _timed_steps(llm, prompts, params) -> list[dict[str, Any]]:
    """Run ``generate`` with every engine step synchronised and recorded."""
    core = llm.engine_core
    original = core.step
    records: list[dict[str, Any]] = []

    def step():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = original()
        torch.cuda.synchronize()
        so = getattr(core, "last_scheduler_output", None)
        records.append({"ms": (time.perf_counter() - t0) * 1e3, "outputs": len(out), "so": so})
        return out

    core.step = step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.step = original
    return records


def _wrap_schedule(core) -> None:
    """Keep the last scheduler output on the core, to class each step."""
    schedule = core.scheduler.schedule

    def wrapped():
        core.last_scheduler_output = schedule()
        return core.last_scheduler_output

    core.scheduler.schedule = wrapped


def step_table(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps grouped into encode (images encoded), prefill (prompt tokens, no image) and
    decode: count, total ms and a few examples of the encode steps."""
    groups: dict[str, list[float]] = defaultdict(list)
    encode_examples = []
    for r in records:
        so = r["so"]
        if so is None:
            groups["unknown"].append(r["ms"])
            continue
        images = sum(len(v) for v in so.scheduled_encoder_inputs.values())
        tokens = so.total_num_scheduled_tokens
        rows = len(so.num_scheduled_tokens)
        kind = "encode" if images else ("prefill" if tokens > rows else "decode")
        groups[kind].append(r["ms"])
        if images and len(encode_examples) < 8:
            encode_examples.append({"images": images, "tokens": tokens, "ms": round(r["ms"], 1)})
    table = {k: {"steps": len(v), "total_ms": sum(v)} for k, v in groups.items()}
    table["encode_examples"] = encode_examples
    return table


def run_steps(args, folder, load_format, out: str) -> dict[str, Any]:
    """The three runs, each on its own fresh requests (no cache of any kind hits)."""
    from mm_serve import LLM, SamplingParams

    llm = LLM(folder, **common.engine_kwargs(args, load_format))
    model_type = llm.config.model.hf_config.model_type

    def prompts(seed: int, n: int = args.num_prompts):
        requests = random_image_dataset(n, 50, args.output_len, (448, 448), seed=seed)
        return common.llm_prompts(requests, common.prompt_texts(requests, model_type))

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts(100, 4), params, use_tqdm=False)
    _wrap_schedule(llm.engine_core)
    batch = prompts(1)
    t0 = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    plain_s = time.perf_counter() - t0
    result = {"plain_run_s": plain_s, "out_tok_s": args.num_prompts * args.output_len / plain_s}
    batch = prompts(2)
    t0 = time.perf_counter()
    records = _timed_steps(llm, batch, params)
    result["synced_run_s"] = time.perf_counter() - t0
    result["steps"] = step_table(records)
    from torch.profiler import ProfilerActivity, profile

    batch = prompts(3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(batch, params, use_tqdm=False)
    averages = prof.key_averages()
    with open(os.path.join(out, "profile_cpu.txt"), "w") as f:
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=60))
    with open(os.path.join(out, "profile_cuda.txt"), "w") as f:
        f.write(averages.table(sort_by="self_device_time_total", row_limit=60))
    tower_requests = random_image_dataset(args.tower_images, 5, 1, (448, 448), seed=4)
    result["tower"] = run_tower(llm, tower_requests)
    common.shutdown(llm)
    return result


def run_tower(llm, requests) -> dict[str, Any]:
    """Host and device time of ``embed_images`` over the requests' images (preprocessed once),
    with SDPA free to choose its backend and with each backend forced."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mm_serve.encoders.processors import get_image_processor

    model = llm.engine_core.model_runner.model
    config = llm.config.model
    processor = get_image_processor(config.path, config.hf_config)
    images = [processor.preprocess(r.images[0]) for r in requests]
    patches = sum(int(i.pixel_values.shape[0]) for i in images)
    flops = tower_flops(
        config.hf_config.vision_config, patches, int(images[0].pixel_values.shape[0])
    )
    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    result: dict[str, Any] = {"images": len(images), "tflop": flops / 1e12}
    for name, backend in backends.items():
        try:
            with sdpa_kernel([backend]) if backend else torch.inference_mode():
                result[name] = _time_tower(model, images, flops)
        except RuntimeError as e:
            result[name] = str(e)[:200]
    return result


def _time_tower(model, images, flops: float) -> dict[str, float]:
    with torch.inference_mode():
        for _ in range(3):
            model.embed_images(images)
        torch.cuda.synchronize()
        host, device = [], []
        for _ in range(10):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            model.embed_images(images)
            end.record()
            host.append((time.perf_counter() - t0) * 1e3)
            end.synchronize()
            device.append(start.elapsed_time(end))
    dev = statistics.median(device)
    return {"host_ms": statistics.median(host), "device_ms": dev, "tflops": flops / dev / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--tower-images", type=int, default=32)
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        folder, load_format = common.model_folder(args, workdir)
        result = run_steps(args, folder, load_format, args.out)
    common.write_json(os.path.join(args.out, "image_profile.json"), result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
