"""The launch heuristics of ``triton_attention.paged_attention_triton``: tile sizes and the
number of KV segments (split-KV), from the step's shape alone (host side, no device reads);
and the SM count they use, which the fused GEMM's persistent grid uses too."""

from __future__ import annotations

import functools

import torch
import triton

MAX_SEGMENTS = 32


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """The SMs of a CUDA ``device``; a small number for Triton's interpreter on a CPU."""
    if device.type != "cuda":
        return 8  # the CPU interpreter: any small number
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_config(
    group: int, max_query_len: int, max_seq_len: int, num_reqs: int, num_kv_heads: int, device
) -> dict[str, int]:
    """Tile sizes and the number of KV segments for one call (host-side heuristics).

    Decode-like batches (every request's queries fit one 16-row block) get 16-row blocks and,
    when ``num_reqs * num_kv_heads`` programs cannot fill the GPU, split-KV: as many segments
    as keep all programs within about one wave of 4 per SM (beyond it, more segments add a
    tail wave and merge work), each segment at least 4 key tiles long. Prefill batches get
    64-row blocks. A batch of one query per request (``ONE_QUERY``: decode steps) launches one
    program per request and KV head, which finds its request by its index rather than by a
    search.
    """
    rows = triton.next_power_of_2(group)
    decode_like = max_query_len * rows <= max(16, rows)
    block_m = max(16, rows) if decode_like else max(64, rows)
    tile_n = 64
    num_segments = 1
    if decode_like:
        target = 4 * num_sms(device)  # programs in flight that keep HBM busy
        want = target // max(1, num_reqs * num_kv_heads)
        most = max(1, max_seq_len // (4 * tile_n))  # at least 4 tiles per segment
        num_segments = int(max(1, min(want, most, MAX_SEGMENTS)))
    return {
        "BLOCK_M": block_m,
        "TILE_N": tile_n,
        "NUM_SEGMENTS": num_segments,
        "ONE_QUERY": max_query_len == 1,
    }
