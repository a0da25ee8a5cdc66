"""Prefill attention through FlashAttention-2's varlen kernel as bundled in torch
(``torch.nn.attention.varlen.varlen_attn``, CUDA, fp16/bf16), beside the paged kernel.

A request with no cached context (a prompt's first chunk without prefix-cache hit, the common
case) attends only to this step's tokens: its keys and values are the layer's fresh ``key`` and
``value``, packed exactly like its queries, so one varlen call over ``query_start_loc``
computes it without reading the paged cache. On the benchmark's prefill shapes that kernel is
faster than the Triton paged kernel (``python -m mm_serve.benchmarks.kernels`` prints both).
Every other request (decode tokens, later prompt chunks, prefix-cache hits) needs the cache:
its rows are gathered into a sub-batch for the paged kernel and scattered back.

The model runner plans the split on the host (:func:`plan_prefill_split`, from the arrays
``_prepare_inputs`` already has: no device-to-host sync); a step without such a prefill gets
no plan, so decode-only steps and their CUDA graphs run the paged kernel alone.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mm_serve.attention import AttentionMetadata
from mm_serve.transfer import host_to_device

PagedKernel = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


@dataclass
class PrefillSplit:
    """One step's split between ``varlen_attn`` and the paged kernel (see the module doc).

    ``paged_rows`` (``[num_paged_tokens]`` int64, device) are the batch rows of the requests
    that need the paged cache, request by request; ``paged_metadata`` describes those requests
    alone, their rows renumbered from 0. Both are None when every request is a fresh prefill.
    """

    paged_rows: torch.Tensor | None
    paged_metadata: AttentionMetadata | None


def varlen_requests(query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """``[num_reqs]`` bool: the requests ``varlen_attn`` serves alone, those whose keys are
    exactly this step's tokens (no cached context) and that have more than one (a one-token
    prompt costs the paged kernel nothing; with this rule a decode-only step never splits)."""
    return (seq_lens == query_lens) & (query_lens > 1)


def plan_prefill_split(
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    seq_lens: np.ndarray,  # [num_reqs]
    block_table: np.ndarray,  # [num_reqs, max_blocks]
    slot_mapping: np.ndarray,  # [num_tokens]
    device: torch.device,
) -> PrefillSplit | None:
    """The split of one step from its host arrays (copied to ``device`` without blocking), or
    None when no request qualifies for ``varlen_attn`` (see :func:`varlen_requests`)."""
    query_lens = np.diff(query_start_loc)
    fresh = varlen_requests(query_lens, seq_lens)
    if not fresh.any():
        return None
    paged = ~fresh & (query_lens > 0)
    if not paged.any():
        return PrefillSplit(None, None)
    reqs = np.nonzero(paged)[0]
    lens = query_lens[reqs]
    sub_starts = np.concatenate([[0], np.cumsum(lens)])
    # Batch row of each sub-batch token: its request's first row plus its offset.
    rows = np.repeat(query_start_loc[reqs] - sub_starts[:-1], lens) + np.arange(sub_starts[-1])
    sub_seq_lens = seq_lens[reqs]

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return host_to_device(torch.from_numpy(np.ascontiguousarray(array)).to(dtype), device)

    metadata = AttentionMetadata(
        num_reqs=len(reqs),
        num_tokens=int(sub_starts[-1]),
        slot_mapping=to_device(slot_mapping[rows], torch.int64),
        query_start_loc=to_device(sub_starts, torch.int32),
        seq_lens=to_device(sub_seq_lens, torch.int32),
        block_table=to_device(block_table[reqs], torch.int32),
        max_query_len=int(lens.max()),
        max_seq_len=int(sub_seq_lens.max()),
        query_start_loc_cpu=sub_starts.tolist(),
        seq_lens_cpu=sub_seq_lens.tolist(),
    )
    return PrefillSplit(to_device(rows, torch.int64), metadata)


@functools.cache
def torch_varlen_attn() -> Callable | None:
    """``torch.nn.attention.varlen.varlen_attn``, or None where this torch lacks it."""
    try:
        return importlib.import_module("torch.nn.attention.varlen").varlen_attn
    except (ImportError, AttributeError):
        return None


@functools.lru_cache(maxsize=64)
def causal_options(fn: Callable, scale: float, head_dim: int, gqa: bool) -> tuple | None:
    """Keyword arguments (as pairs) that make ``fn`` causal with softmax scale ``scale``, or
    None where its signature cannot. torch 2.10 takes ``is_causal`` (and no scale: only the
    default ``head_dim ** -0.5`` works); 2.11 ``scale`` and ``window_size`` ((-1, 0) is
    causal); 2.12 asks ``enable_gqa`` for fewer KV heads (earlier ones hand GQA to
    FlashAttention-2, which supports it natively)."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        options = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        options = {"is_causal": True}
    else:
        return None
    if "scale" in params:
        options["scale"] = scale
    elif not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        return None
    if gqa and "enable_gqa" in params:
        options["enable_gqa"] = True
    return tuple(options.items())


@functools.lru_cache(maxsize=8)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def varlen_unusable_reason(query: torch.Tensor, kv_heads: int, scale: float) -> str | None:
    """Why ``varlen_attn`` cannot serve this layer (a sentence for the log), or None.

    ``query``: ``[num_tokens, num_heads, head_dim]``. FlashAttention-2 needs an sm80+ GPU,
    fp16/bf16 and a head dim <= 256 divisible by 8.
    """
    fn = torch_varlen_attn()
    if fn is None:
        return "this torch has no torch.nn.attention.varlen"
    if not query.is_cuda or _capability(query.device)[0] < 8:
        return "varlen_attn needs an sm80+ CUDA device"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"varlen_attn needs fp16/bf16, got {query.dtype}"
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > 256:
        return f"varlen_attn needs head_dim <= 256 divisible by 8, got {head_dim}"
    if causal_options(fn, scale, head_dim, query.shape[1] != kv_heads) is None:
        return "this torch's varlen_attn takes no causal flag or softmax scale"
    return None


def paged_attention_split(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this step's (rotated) keys
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    paged_kernel: PagedKernel,
) -> torch.Tensor:
    """Contract of ``paged_attention_ref``, for a step with ``metadata.prefill_split`` set.

    One ``varlen_attn`` call treats every request as if its keys were its new tokens, which is
    exact for the fresh prefills; the rows of the other requests are then overwritten with
    ``paged_kernel``'s result on their sub-batch (their wasted varlen work is their new tokens'
    self-attention: one token for a decode row). ``key``/``value`` may be strided views with a
    contiguous last dim; the cache must already hold this step's K/V. Rows past
    ``metadata.num_tokens`` are zero. Call only when :func:`varlen_unusable_reason` is None.
    """
    split = metadata.prefill_split
    num_tokens = metadata.num_tokens
    fn = torch_varlen_attn()
    gqa = query.shape[1] != key.shape[1]
    options = dict(causal_options(fn, scale, query.shape[-1], gqa))
    cu_seqlens, max_len = metadata.query_start_loc, metadata.max_query_len
    attn = fn(
        query[:num_tokens], key[:num_tokens], value[:num_tokens],
        cu_seqlens, cu_seqlens, max_len, max_len, **options,
    )  # fmt: skip
    if split.paged_rows is not None:
        rows = split.paged_rows
        attn[rows] = paged_kernel(query[rows], kv_cache, split.paged_metadata, scale)
    if num_tokens == query.shape[0]:
        return attn
    out = torch.zeros_like(query)
    out[:num_tokens] = attn
    return out
