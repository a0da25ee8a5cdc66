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
    """Run ``generate`` with every engine step synchronised and recorded: its wall time
    (``ms``), the host time until the runner had launched it (``launch_ms``: scheduling,
    input preparation and kernel launches) and the device time of its kernels (``device_ms``,
    CUDA events around ``execute_model``)."""
    core = llm.engine_core
    original, execute = core.step, core.model_runner.execute_model
    records: list[dict[str, Any]] = []
    marks: dict[str, Any] = {}

    def timed_execute(scheduler_output, *args):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        pending = execute(scheduler_output, *args)
        end.record()
        marks.update(launched=time.perf_counter(), events=(start, end))
        return pending

    def step():
        torch.cuda.synchronize()
        marks.clear()
        t0 = time.perf_counter()
        out = original()
        torch.cuda.synchronize()
        so = getattr(core, "last_scheduler_output", None)
        record = {"ms": (time.perf_counter() - t0) * 1e3, "outputs": len(out), "so": so}
        if "events" in marks:
            record["launch_ms"] = (marks["launched"] - t0) * 1e3
            record["device_ms"] = marks["events"][0].elapsed_time(marks["events"][1])
        records.append(record)
        return out

    core.step, core.model_runner.execute_model = step, timed_execute
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.step, core.model_runner.execute_model = original, execute
    return records


def _async_steps(llm, prompts, params) -> list[dict[str, Any]]:
    """Run ``generate`` unsynchronised (as users run it), recording each step's wall time and
    what it scheduled: with async scheduling a step's wall time is the larger of the host's
    work and the device's (it waits for the step before)."""
    core = llm.engine_core
    original = core.step
    records: list[dict[str, Any]] = []

    def step():
        t0 = time.perf_counter()
        out = original()
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


def _step_kind(so) -> str:
    if so is None:
        return "unknown"
    if any(so.scheduled_encoder_inputs.values()):
        return "encode"
    tokens, rows = so.total_num_scheduled_tokens, len(so.num_scheduled_tokens)
    return "prefill" if tokens > rows else ("decode" if rows else "empty")


def step_table(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps grouped into encode (images encoded), prefill (prompt tokens, no image), decode
    and empty: count, total ms (and total launch/device ms where recorded), and the first
    steps in order (kind, images, tokens, rows, ms)."""
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    first_steps = []
    for r in records:
        so, kind = r["so"], _step_kind(r["so"])
        group = groups[kind]
        group["steps"] += 1
        for key in ("ms", "launch_ms", "device_ms"):
            if key in r:
                group[f"total_{key}"] += r[key]
        if len(first_steps) < 24 and so is not None:
            images = sum(len(v) for v in so.scheduled_encoder_inputs.values())
            first_steps.append([kind, images, so.total_num_scheduled_tokens,
                                len(so.num_scheduled_tokens)] + [
                round(r[k], 2) for k in ("ms", "launch_ms", "device_ms") if k in r])  # fmt: skip
    table: dict[str, Any] = {k: dict(v) for k, v in groups.items()}
    table["first_steps"] = first_steps
    return table


def run_steps(args, folder, load_format, out: str) -> dict[str, Any]:
    """The three runs, each on its own fresh requests (no cache of any kind hits)."""
    from mm_serve import LLM, SamplingParams

    llm = LLM(folder, **common.engine_kwargs(args, load_format, multiprocess=False))
    model_type = llm.config.model.hf_config.model_type

    def prompts(seed: int, n: int = args.num_prompts):
        requests = random_image_dataset(n, 50, args.output_len, (448, 448), seed=seed)
        return common.image_prompts(requests, model_type)

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts(100, 4), params, use_tqdm=False)
    _wrap_schedule(llm.engine_core)
    for name, seed in (("cold", 7), ("warm", 8)) if args.host_profile else ():
        _host_profile(llm, prompts(seed), params, os.path.join(out, f"host_{name}.txt"))
    plain = []
    for seed in (1, 2, 3):  # the first run on fresh images is where a cold start would show
        t0 = time.perf_counter()
        llm.generate(prompts(seed), params, use_tqdm=False)
        plain.append(time.perf_counter() - t0)
    result = {
        "plain_runs_s": plain,
        "out_tok_s": [args.num_prompts * args.output_len / s for s in plain],
    }
    records = _async_steps(llm, prompts(4), params)
    result["async_steps"] = step_table(records)
    t0 = time.perf_counter()
    records = _timed_steps(llm, prompts(5), params)
    result["synced_run_s"] = time.perf_counter() - t0
    result["steps"] = step_table(records)
    from torch.profiler import ProfilerActivity, profile

    batch = prompts(6)
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


def _host_profile(llm, prompts, params, path: str) -> None:
    """``generate`` under cProfile (the host's Python functions, cumulative and own time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(llm.generate, prompts, params, use_tqdm=False)
    with open(path, "w") as f:
        stats = pstats.Stats(profiler, stream=f)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)


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
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="Run generate under cProfile on a fresh engine's first batch and on a later one.",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        folder, load_format = common.model_folder(args, workdir)
        result = run_steps(args, folder, load_format, args.out)
    common.write_json(os.path.join(args.out, "image_profile.json"), result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
