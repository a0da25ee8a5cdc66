"""Launch, at start-up, the cuBLAS kernels that the eager steps' GEMMs will pick.

cuBLAS picks its kernel by shape (tens of kernels as the token count ``M`` varies), and the
first launch of each in a process waits until the device has run everything queued, which
delays the next step. CUDA graphs load theirs at capture; this warms the eager steps':

- the logits, ``compute_logits`` at every row count up to ``max_num_seqs``;
- the LM's linear layers (one per weight shape) at every ``STRIDE``-th token count up to
  ``max_num_batched_tokens`` (wider beyond ``MAX_COUNTS`` counts), and at that count itself.

Counts between two warmed ones may still pay one such wait, once."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from mm_serve.models.layers.linear import LinearBase, RowParallelLinear

logger = logging.getLogger(__name__)

STRIDE = 8  # token counts between two warmed LM GEMMs
MAX_COUNTS = 1024  # at most this many token counts (bounds the warm-up's share of start-up)


def lm_gemm_shapes(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(weight [N, K], bias [N] or None)`` of each distinct GEMM the LM's linear layers run
    (``LinearBase``; the vision tower's ``nn.Linear`` layers run in CUDA graphs; quantized
    layers run their own kernels). A layer with a bias gives the GEMM with it and without it:
    compiled code may add the bias apart."""
    gemms: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for module in model.modules():
        if not isinstance(module, LinearBase) or module.quant_method is not None:
            continue
        weight = module.weight
        biases = [None]
        if module.bias is not None and not isinstance(module, RowParallelLinear):
            biases.append(module.bias)  # (a row-parallel bias is added after the all-reduce)
        for bias in biases:
            gemms.setdefault((tuple(weight.shape), weight.dtype, bias is None), (weight, bias))
    return list(gemms.values())


def token_counts(max_num_tokens: int) -> list[int]:
    """The token counts the LM GEMMs are warmed at: 1, every ``STRIDE``-th (wider when that
    would exceed ``MAX_COUNTS``) and ``max_num_tokens``, ascending."""
    stride = max(STRIDE, -(-max_num_tokens // MAX_COUNTS))
    return sorted({1, *range(stride, max_num_tokens + 1, stride), max_num_tokens})


@torch.inference_mode()
def warm_gemm_kernels(model: torch.nn.Module, max_num_seqs: int, max_num_tokens: int) -> None:
    """Run the LM head over ``1..max_num_seqs`` rows and each LM GEMM (``lm_gemm_shapes``)
    over every ``STRIDE``-th token count (or wider) up to ``max_num_tokens`` and that count
    itself, on zero inputs; waits for the device at the end."""
    start = time.perf_counter()
    head = model.lm_head.weight
    hidden = torch.zeros(max_num_seqs, head.shape[1], dtype=head.dtype, device=head.device)
    for m in range(1, max_num_seqs + 1):
        model.compute_logits(hidden[:m])
    counts = token_counts(max_num_tokens)
    shapes = lm_gemm_shapes(model)
    for weight, bias in shapes:
        x = torch.zeros(max_num_tokens, weight.shape[1], dtype=weight.dtype, device=weight.device)
        for m in counts:
            F.linear(x[:m], weight, bias)
    torch.cuda.synchronize(head.device)
    logger.info(
        "Launched the LM head's GEMM for 1-%d rows and %d LM GEMM shapes for %d token counts "
        "in %.1f s.",
        max_num_seqs,
        len(shapes),
        len(counts),
        time.perf_counter() - start,
    )
