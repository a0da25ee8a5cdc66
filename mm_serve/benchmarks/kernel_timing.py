"""What the kernel benchmarks (``kernels``, ``prefill_attention``, ``vision_attention``) share:
a median timer, a CUDA-graph timer, a relative error, causal attention FLOPs and a random paged
batch."""

from __future__ import annotations

import random

import torch

from mm_serve.kernels.attention_metadata import paged_metadata


def bench(fn, rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn()`` (do_bench: warm-up, L2 flushed, CUDA events)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def time_calls(fn, copies: int, replays: int = 20) -> float:
    """Mean microseconds per call of ``fn(i)`` for ``i`` in ``range(copies)``, graph-replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * copies)


def paged_batch(reqs, heads, block_size: int, dtype: torch.dtype, seed: int = 0):
    """Random query and paged cache (shuffled blocks) for ``reqs`` = [(cached, new)]."""
    num_heads, num_kv_heads, head_dim = heads
    need = [-(-(c + n) // block_size) for c, n in reqs]
    blocks = list(range(sum(need)))
    random.Random(seed).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(n)] for n in need]
    kv_cache = torch.randn(2, sum(need), block_size, num_kv_heads, head_dim, device="cuda")
    metadata = paged_metadata(reqs, tables, block_size, "cuda")
    query = torch.randn(metadata.num_tokens, num_heads, head_dim, device="cuda")
    return query.to(dtype), kv_cache.to(dtype), metadata


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def causal_flops(reqs, heads) -> float:
    """FLOPs of causal attention for ``reqs`` = [(cached, new)]: two matmuls of ``2 * head_dim``
    FLOPs per visible (query, key) pair and query head; new token ``j`` sees ``cached + j + 1``
    keys."""
    return sum(4 * n * (c + (n + 1) / 2) * heads[2] * heads[0] for c, n in reqs)
