"""Prefill attention through FlashAttention-2's varlen kernel as bundled in torch
(``torch.nn.attention.varlen.varlen_attn``; CUDA sm80+, fp16/bf16), beside the paged kernel.

A request with no cached context attends only to this step's tokens, packed like its queries,
so one varlen call over ``query_start_loc`` computes it without reading the paged cache. Every
other request (decode, later chunks, prefix-cache hits) is gathered into a sub-batch for the
paged kernel and scattered back. The engine splits only steps of fresh prompts alone averaging
``MIN_VARLEN_PROMPT_LEN`` tokens or more (:func:`worth_splitting`); below that the paged kernel
alone is faster.

The model runner plans the split on the host (:func:`plan_prefill_split`, no device-to-host
sync); a step without such a prefill gets no plan, so decode steps and their CUDA graphs run
the paged kernel alone."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.utils.transfer import host_to_device

PagedKernel = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


@dataclass
class PrefillSplit:
    """One step's split between the varlen kernel and the paged kernel (see the module doc).

    ``paged_rows`` (``[num_paged_tokens]`` int64, device) are the batch rows of the requests
    that need the paged cache, request by request; ``paged_metadata`` describes those requests
    alone, their rows renumbered from 0. Both are None when every request is a fresh prefill.
    """

    paged_rows: torch.Tensor | None
    paged_metadata: AttentionMetadata | None


# Fresh prompts at least this long on average (tokens) go to the varlen kernel (module doc).
MIN_VARLEN_PROMPT_LEN = 2048


def worth_splitting(query_start_loc: np.ndarray, seq_lens: np.ndarray) -> bool:
    """Whether the engine splits this step: every request a fresh prompt (``varlen_requests``)
    and their mean length at least ``MIN_VARLEN_PROMPT_LEN`` (see the module doc)."""
    query_lens = np.diff(query_start_loc)
    fresh = varlen_requests(query_lens, seq_lens)
    return bool(fresh.all()) and query_lens.mean() >= MIN_VARLEN_PROMPT_LEN


def varlen_requests(query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """``[num_reqs]`` bool: the requests the varlen kernel serves alone, those whose keys are
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
    None when no request qualifies for the varlen kernel (see :func:`varlen_requests`)."""
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
def has_flash_varlen() -> bool:
    """Whether this torch bundles FlashAttention-2's varlen kernel (it ships
    ``torch.nn.attention.varlen`` with it)."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def flash_varlen(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32: sequence i is rows cu[i]:cu[i+1]
    max_len: int,
    scale: float | None = None,  # None: head_dim ** -0.5
    causal: bool = True,
) -> torch.Tensor:
    """Attention within each packed sequence, ``[num_tokens, num_heads, head_dim]``.

    Calls ``aten._flash_attention_forward`` as ``torch.nn.attention.varlen.varlen_attn`` does,
    without that wrapper's custom-op dispatch and per-call allocations (paid once per layer),
    and with GQA as FlashAttention-2 runs it natively (``num_heads % num_kv_heads == 0``).
    Inputs may be strided views with a contiguous last dim.
    """
    forward = torch.ops.aten._flash_attention_forward
    lens = (cu_seqlens, cu_seqlens, max_len, max_len)
    return forward(query, key, value, *lens, 0.0, causal, False, scale=scale)[0]


@dataclass(frozen=True)
class Segments:
    """A vision tower forward's attention segments (``dispatch.varlen_segments``, once per
    forward): rows ``[cu_seqlens[i], cu_seqlens[i + 1])`` (int32, device) attend to each other;
    ``groups``: one ``[num_segments, length]`` row index per length for SDPA, or None;
    ``dense``: True when the segments, all of ``max_len`` rows, go to cuDNN as one
    ``[num_segments, heads, max_len, head_dim]`` batch (``dense_attention``)."""

    cu_seqlens: torch.Tensor
    max_len: int
    groups: list[torch.Tensor] | None
    dense: bool = False


def make_segments(
    bounds: list[int], device: torch.device, flash: bool, dense: bool = True
) -> Segments:
    """The segments ``[bounds[i], bounds[i + 1])`` (empty ones dropped) on ``device``, grouped
    by length unless ``flash``; with ``flash`` and ``dense``, segments of one length are
    ``dense`` where cuDNN's attention is the faster kernel (``has_dense_cudnn``). A forward
    that runs once per shape passes ``dense=False``: cuDNN builds a plan per new shape (tens
    of ms of host time), FlashAttention-2 none."""
    bounds = [b for i, b in enumerate(bounds) if i == 0 or b != bounds[i - 1]]
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    cu_seqlens = host_to_device(torch.tensor(bounds, dtype=torch.int32), device)
    max_len = max(lengths, default=0)
    if flash:
        dense = dense and len(set(lengths)) == 1 and has_dense_cudnn(device)
        return Segments(cu_seqlens, max_len, None, dense)
    by_length: dict[int, list[int]] = {}
    for start, length in zip(bounds[:-1], lengths, strict=True):
        by_length.setdefault(length, []).append(start)
    groups = [
        host_to_device(torch.tensor(starts)[:, None] + torch.arange(length), device)
        for length, starts in by_length.items()
    ]
    return Segments(cu_seqlens, max_len, groups)


def has_dense_cudnn(device: torch.device) -> bool:
    """Whether equal segments go to cuDNN's attention (``dense_attention``): on sm90+ GPUs
    with cuDNN, where it beats FlashAttention-2's varlen kernel (which pads head dim 80 or 72
    to 96)."""
    return torch.backends.cudnn.is_available() and _capability(device)[0] >= 9


# cuDNN builds an execution plan for each new input shape (tens of ms of host time, the first
# call only), so a batch goes in power-of-two parts of at most this many segments: one image
# size needs at most five plans, which start-up builds for photo-sized images
# (``tower_graphs.EncoderCudaGraphs.capture_photos``).
MAX_DENSE_BATCH = 16


def dense_parts(num_segments: int) -> list[int]:
    """``num_segments`` as powers of two of at most ``MAX_DENSE_BATCH``, largest first
    (27 -> [16, 8, 2, 1]; 40 -> [16, 16, 8])."""
    parts = [MAX_DENSE_BATCH] * (num_segments // MAX_DENSE_BATCH)
    rest = num_segments % MAX_DENSE_BATCH
    return parts + [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_len: int
) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of ``segment_len`` rows each,
    through cuDNN's fused attention on ``[segments, heads, segment_len, head_dim]`` views of
    each part (``dense_parts``): ``q, k, v: [N, heads, head_dim]`` (last dim contiguous) ->
    ``[N, heads, head_dim]``, scale ``head_dim ** -0.5``.

    Same-size images make such segments; for them cuDNN's kernel beats the varlen kernel,
    which pads head_dim 80 to 96 (``mm-serve bench kernels``).
    """
    parts = dense_parts(q.shape[0] // segment_len)
    if len(parts) == 1:
        return cudnn_segments(q, k, v, segment_len)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    start = 0
    for count in parts:
        rows = slice(start, start + count * segment_len)
        out[rows] = cudnn_segments(q[rows], k[rows], v[rows], segment_len)
        start = rows.stop
    return out


def cudnn_segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_len: int
) -> torch.Tensor:
    """``dense_attention`` in one cuDNN call over all segments (whatever their number)."""
    n, heads, head_dim = q.shape
    q, k, v = (
        t.view(n // segment_len, segment_len, heads, head_dim).transpose(1, 2) for t in (q, k, v)
    )
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False)[0]
    return out.transpose(1, 2).reshape(n, heads, head_dim)


def segment_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments
) -> torch.Tensor:
    """Bidirectional attention within segments, ``[N, num_heads, head_dim]`` each, scale
    ``head_dim ** -0.5``: one batched SDPA call per distinct segment length (e.g. per image
    size or Qwen2.5-VL window size), so no image is padded to another's length and no
    ``N x N`` block-diagonal mask is ever built."""
    out = torch.empty_like(q)
    for idx in segments.groups:  # [num_segments, length] row indices
        qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))  # [B, heads, length, head_dim]
        out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


@functools.lru_cache(maxsize=8)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def varlen_unusable_reason(query: torch.Tensor) -> str | None:
    """Why FlashAttention-2's varlen kernel cannot serve this layer (a sentence for the log),
    or None. ``query``: ``[num_tokens, num_heads, head_dim]``; the kernel needs an sm80+ GPU,
    fp16/bf16 and a head dim <= 256 divisible by 8."""
    if not has_flash_varlen():
        return "this torch has no torch.nn.attention.varlen"
    if not query.is_cuda or _capability(query.device)[0] < 8:
        return "FlashAttention-2 needs an sm80+ CUDA device"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-2 needs fp16/bf16, got {query.dtype}"
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > 256:
        return f"FlashAttention-2 needs head_dim <= 256 divisible by 8, got {head_dim}"
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

    One varlen call (:func:`flash_varlen`) treats every request as if its keys were its
    new tokens, which is exact for the fresh prefills; the rows of the other requests are then
    overwritten with ``paged_kernel``'s result on their sub-batch (their wasted varlen work is
    their new tokens' self-attention: one token for a decode row). ``key``/``value`` may be
    strided views with a contiguous last dim; the cache must already hold this step's K/V. Rows
    past ``metadata.num_tokens`` are zero. Call only when :func:`varlen_unusable_reason` is
    None.
    """
    split = metadata.prefill_split
    num_tokens = metadata.num_tokens
    attn = flash_varlen(
        query[:num_tokens], key[:num_tokens], value[:num_tokens],
        metadata.query_start_loc, metadata.max_query_len, scale,
    )  # fmt: skip
    if split.paged_rows is not None:
        rows = split.paged_rows
        attn[rows] = paged_kernel(query[rows], kv_cache, split.paged_metadata, scale)
    padding = query.shape[0] - num_tokens  # rows of a padded (captured) batch: zero
    return F.pad(attn, (0, 0, 0, 0, 0, padding)) if padding else attn
