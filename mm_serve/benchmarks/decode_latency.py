"""Decode-step latency with CUDA graphs on and off, against the weight-read floor.

Builds the Qwen2-VL-2B-Instruct architecture from its published ``config.json`` values with
random bf16 weights (no checkpoint is needed: the model is built on ``meta``, materialised on
the GPU and filled with random numbers), runs the real ``EngineCore`` (scheduler, runner,
sampler) with ``B`` text requests of ``PROMPT_LEN`` tokens, and times ``EngineCore.step()``
once every request is decoding (median over ``--steps`` steps after warm-up; each step ends
with the sampled tokens on the host, so wall time is the step's latency).

The floor is the LM's weight bytes (what one decode step must read; the vision tower is not
used) divided by the device-to-device copy bandwidth measured here (bytes read + written).

    python -m mm_serve.benchmarks.decode_latency [--batch-sizes 1 8 32] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from unittest import mock

import torch

from mm_serve.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    cuda_graph_batch_sizes,
)
from mm_serve.request import Request
from mm_serve.sampling_params import SamplingParams

PROMPT_LEN = 306  # one 448x448 image (256 tokens) + ~50 text tokens, as in FACTS.md's baseline
MAX_MODEL_LEN = 4096


def qwen2_vl_2b_config():
    """Qwen2-VL-2B-Instruct's ``config.json`` (text and vision), built in code."""
    from transformers import Qwen2VLConfig

    text = dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    )
    vision = dict(
        depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16, patch_size=14,
        spatial_merge_size=2, in_chans=3, temporal_patch_size=2,
    )  # fmt: skip
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,
        architectures=["Qwen2VLForConditionalGeneration"],
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
    )


def engine_config(max_num_seqs: int, enforce_eager: bool) -> EngineConfig:
    hf_config = qwen2_vl_2b_config()
    model = ModelConfig("random:Qwen2-VL-2B", "", hf_config, torch.bfloat16, MAX_MODEL_LEN, "")
    scheduler = SchedulerConfig(
        max_num_batched_tokens=8192, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN
    )
    compilation = CompilationConfig(enforce_eager, cuda_graph_batch_sizes(max_num_seqs))
    return EngineConfig(
        model=model,
        cache=CacheConfig(gpu_memory_utilization=0.5),
        scheduler=scheduler,
        parallel=ParallelConfig(),
        device=torch.device("cuda"),
        multimodal=MultiModalConfig(),
        compilation=compilation,
    )


def load_random_model(runner) -> None:
    """``ModelRunner.load_model`` with random weights (N(0, 0.02); norms 1, biases 0)."""
    from mm_serve.models.registry import get_model_class

    cfg = runner.config.model
    torch.set_default_dtype(cfg.dtype)
    try:
        with torch.device("meta"):
            model = get_model_class(cfg.hf_config)(cfg.hf_config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.to_empty(device=runner.device)
    if model.tie_word_embeddings:  # to_empty gives each module its own tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if hasattr(module, "rebuild_buffers"):
            module.rebuild_buffers()
    gen = torch.Generator(runner.device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.02, generator=gen)
            else:
                param.fill_(1.0 if "norm" in name else 0.0)
    runner.model = model.eval()


def lm_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters a decode step reads: the LM but the vision tower and the token
    embedding (of which a step reads ``B`` rows), with the LM head (tied or not) counted once."""
    seen, total = set(), 0
    for name, param in model.named_parameters(remove_duplicate=False):
        skip = name.startswith("visual.") or "embed_tokens" in name
        if skip or param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        total += param.numel() * param.element_size()
    return total


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second (median of 20)."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times[5:])
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def time_decode(core, batch: int, steps: int, warmup: int = 10) -> tuple[float, float]:
    """(median, p90) ms of ``core.step()`` with ``batch`` requests all decoding."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 8, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(0, 150000, (PROMPT_LEN,), generator=gen).tolist()
        core.add_request(Request(f"b{batch}-{i}", ids, params))
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in _requests(core)):
        core.step()  # prefill (possibly several steps)
    for _ in range(warmup):
        core.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - start) * 1e3)
    while core.has_unfinished_requests():
        core.step()
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def _requests(core):
    return list(core.scheduler.requests.values())


def build_core(max_num_seqs: int, enforce_eager: bool):
    from mm_serve.engine.core import EngineCore
    from mm_serve.worker.model_runner import ModelRunner

    with mock.patch.object(ModelRunner, "load_model", load_random_model):
        return EngineCore(engine_config(max_num_seqs, enforce_eager))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    rows = []
    for eager in (False, True):
        core = build_core(max(args.batch_sizes), enforce_eager=eager)
        weight_bytes = lm_weight_bytes(core.model_runner.model)
        graphs = core.model_runner.cuda_graphs
        assert (graphs is None) == eager
        for batch in args.batch_sizes:
            replays = graphs.num_replays if graphs else 0
            median, p90 = time_decode(core, batch, args.steps)
            replayed = (graphs.num_replays - replays) if graphs else 0
            rows.append(dict(batch=batch, graphs=not eager, median_ms=median, p90_ms=p90,
                             graph_replays=replayed))  # fmt: skip
        del core, graphs
        torch.cuda.empty_cache()
    floor_ms = weight_bytes / bandwidth * 1e3
    result = dict(
        device=torch.cuda.get_device_name(),
        model="Qwen2-VL-2B text architecture, random bf16 weights",
        prompt_len=PROMPT_LEN,
        lm_weight_bytes=weight_bytes,
        copy_bandwidth_bytes_per_s=bandwidth,
        floor_ms=floor_ms,
        rows=rows,
    )
    with open(os.path.join(args.out, "decode_latency.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}; {result['model']}; prompt {PROMPT_LEN} tokens")
    print(f"LM weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e12:.2f} TB/s "
          f"(read+write) -> weight-read floor {floor_ms:.3f} ms/step")  # fmt: skip
    print(f"{'batch':>5} {'graphs ms':>10} {'eager ms':>10} {'speedup':>8} {'x floor':>8} "
          f"{'tok/s':>8}")  # fmt: skip
    for batch in args.batch_sizes:
        g = next(r for r in rows if r["batch"] == batch and r["graphs"])
        e = next(r for r in rows if r["batch"] == batch and not r["graphs"])
        print(f"{batch:>5} {g['median_ms']:>10.3f} {e['median_ms']:>10.3f} "
              f"{e['median_ms'] / g['median_ms']:>7.2f}x {g['median_ms'] / floor_ms:>7.2f}x "
              f"{batch / g['median_ms'] * 1e3:>8.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
