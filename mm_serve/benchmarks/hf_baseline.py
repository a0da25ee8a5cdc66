"""The HF transformers baseline of ``bench throughput``: ``generate`` on the same requests.

The model is built from the folder's ``config.json`` directly on the device in the bench
dtype (random weights from HF's own init, run there: no CPU init, no weight files), with
``attn_implementation="sdpa"``; inputs come from the folder's HF processor (left padding).
Each batch size runs ``num_batches`` batches of that many requests (cycling through the
requests if there are fewer), greedy, with ``min_new_tokens = max_new_tokens = output_len``
so every row gives exactly ``output_len`` tokens. A batch is timed from the processor call
to the generated ids (preprocessing included, as in our engine's figure):
tok/s = output tokens / seconds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mm_serve.benchmarks.common import free_device_memory
from mm_serve.benchmarks.datasets import BenchRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HFBatchResult:
    """One batch size: totals over its batches, or the error that stopped it (e.g. OOM)."""

    batch_size: int
    num_batches: int
    output_tokens: int = 0
    elapsed_s: float = 0.0  # processor + generate, summed over the batches
    generate_s: float = 0.0  # generate alone
    output_tokens_per_s: float = 0.0
    error: str | None = None


def build_hf_model(folder: str, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """The folder's HF image-text-to-text model with random weights, built on ``device``."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(seed)
    with torch.device(device):  # parameters and rotary buffers are created (and init) there
        model = AutoModelForImageTextToText.from_config(
            config, dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval()


def load_hf_processor(folder: str) -> Any:
    from mm_serve.utils._compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    return processor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate_batch(
    model: Any,
    processor: Any,
    requests: list[BenchRequest],
    texts: list[str],
    output_len: int,
) -> tuple[float, float]:
    """Run one batch; returns (seconds with preprocessing, seconds of ``generate``).

    Raises ``RuntimeError`` if a row did not get exactly ``output_len`` new tokens.
    """
    device = model.device
    images = [image for r in requests for image in r.images] or None
    tokenizer = processor.tokenizer
    _sync(device)
    start = time.perf_counter()
    inputs = processor(text=texts, images=images, padding=True, return_tensors="pt").to(device)
    _sync(device)
    generate_start = time.perf_counter()
    sequences = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    _sync(device)
    end = time.perf_counter()
    new_tokens = sequences.shape[1] - inputs["input_ids"].shape[1]
    if new_tokens != output_len:
        raise RuntimeError(f"HF generate gave {new_tokens} new tokens, not {output_len}.")
    return end - start, end - generate_start


def _time_batch_size(
    model, processor, requests, texts, batch_size: int, num_batches: int, output_len: int
) -> HFBatchResult:
    """``num_batches`` batches of ``batch_size`` requests (cycling through ``requests``)."""
    elapsed = generate_s = 0.0
    for b in range(num_batches):
        rows = [(b * batch_size + i) % len(requests) for i in range(batch_size)]
        total, gen = generate_batch(
            model, processor, [requests[i] for i in rows], [texts[i] for i in rows], output_len
        )
        elapsed += total
        generate_s += gen
    tokens = batch_size * num_batches * output_len
    return HFBatchResult(batch_size, num_batches, tokens, elapsed, generate_s, tokens / elapsed)


def run_hf_baseline(
    folder: str,
    requests: list[BenchRequest],
    texts: list[str],
    batch_sizes: list[int],
    output_len: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    num_batches: int = 1,
) -> dict[str, Any]:
    """HF ``generate`` throughput at each batch size; frees the model's memory before it
    returns. Returns ``{"batches": [HFBatchResult as dict, ...], "best": the fastest}``; a
    batch size that runs out of memory is recorded with its error and skipped."""
    model = build_hf_model(folder, dtype, device, seed)
    processor = load_hf_processor(folder)
    results: list[HFBatchResult] = []
    try:
        warm = min(2, len(requests))  # kernels, allocator, processor warm
        generate_batch(model, processor, requests[:warm], texts[:warm], min(output_len, 4))
        for batch_size in batch_sizes:
            try:
                result = _time_batch_size(
                    model, processor, requests, texts, batch_size, num_batches, output_len
                )
            except torch.cuda.OutOfMemoryError as e:
                result = HFBatchResult(batch_size, num_batches, error=f"out of memory: {e}")
                free_device_memory()
            logger.info("HF batch %d: %s", batch_size, result)
            results.append(result)
    finally:
        del model
        free_device_memory()
    ok = [r for r in results if r.error is None]
    best = max(ok, key=lambda r: r.output_tokens_per_s) if ok else None
    return {
        "attn_implementation": "sdpa",
        "batches": [asdict(r) for r in results],
        "best": asdict(best) if best else None,
    }
