"""The pure-torch kernel references against naive dense computations and HF's own code."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from mm_serve.kernels import (
    apply_rotary_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from mm_serve.kernels.attention_metadata import AttentionMetadata, paged_metadata


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Naive reference: full causal attention over the whole sequence, float64, heads looped.

    ``q, k, v: [seq_len, heads(_kv), d]`` -> ``[seq_len, heads, d]``.
    """
    seq_len, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    for h in range(num_heads):
        scores = q[:, h].double() @ k[:, h // group].double().T * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[:, h] = probs @ v[:, h // group].double()
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_paged_attention_matches_dense_causal(num_heads: int, num_kv_heads: int) -> None:
    torch.manual_seed(0)
    head_dim, block_size, num_blocks, scale = 16, 4, 48, 0.3
    # (tokens already cached, tokens computed this step): full prefills, a chunk with a cached
    # prefix, decode tokens, and a 1-token prefill.
    reqs = [(0, 9), (6, 5), (13, 1), (0, 1), (22, 1), (3, 8)]
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    queries, expected, slot_mapping, tables, seq_lens, starts = [], [], [], [], [], [0]
    for cached, new in reqs:
        seq_len = cached + new
        q, k, v = (
            torch.randn(seq_len, n, head_dim) for n in (num_heads, num_kv_heads, num_kv_heads)
        )
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        )
        reshape_and_cache_ref(k[:cached], v[:cached], kv_cache, slots[:cached])  # earlier steps
        slot_mapping.append(slots[cached:])
        queries.append(q[cached:])
        expected.append(_dense_causal(q, k, v, scale)[cached:])
        tables.append(table)
        seq_lens.append(seq_len)
        starts.append(starts[-1] + new)
        reshape_and_cache_ref(k[cached:], v[cached:], kv_cache, slots[cached:])  # this step
    width = max(map(len, tables))
    metadata = AttentionMetadata(
        num_reqs=len(reqs),
        num_tokens=starts[-1],
        slot_mapping=torch.cat(slot_mapping),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(new for _, new in reqs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    out = paged_attention_ref(torch.cat(queries), kv_cache, metadata, scale)
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_decode_rows_are_batch_invariant() -> None:
    """A decode request's attention is bit for bit the same alone and batched beside longer
    requests (the batched decode path pads to the longest): a served request's tokens do not
    depend on what else runs."""
    torch.manual_seed(1)
    block_size, num_blocks, num_heads, num_kv_heads, head_dim = 4, 64, 8, 2, 16
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    tables = [list(range(b, b + 16)) for b in (0, 16, 32, 48)]
    reqs = [(6, 1), (60, 1), (0, 5), (33, 1)]  # (cached, new): three decodes and a prefill
    query = torch.randn(sum(n for _, n in reqs), num_heads, head_dim)
    batched = paged_attention_ref(
        query, kv_cache, paged_metadata(reqs, tables, block_size, "cpu"), 0.3
    )
    start = 0
    for (cached, new), table in zip(reqs, tables, strict=True):
        alone = paged_metadata([(cached, new)], [table], block_size, "cpu")
        rows = slice(start, start + new)
        assert torch.equal(batched[rows], paged_attention_ref(query[rows], kv_cache, alone, 0.3))
        start += new


def test_reshape_and_cache_writes_slots_and_skips_padding() -> None:
    kv_cache = torch.zeros(2, 3, 4, 2, 8)
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    reshape_and_cache_ref(key, value, kv_cache, torch.tensor([9, 2, -1, 4]))
    torch.testing.assert_close(kv_cache[0, 2, 1], key[0])  # slot 9 = block 2, offset 1
    torch.testing.assert_close(kv_cache[1, 0, 2], value[1])
    torch.testing.assert_close(kv_cache[0, 1, 0], key[3])
    assert int((kv_cache != 0).any(-1).any(-1).sum()) == 6  # 3 slots, K and V each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = LlamaRMSNorm(32, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm_ref(x, norm.weight, 1e-5), norm(x), atol=0, rtol=0)
        out, new_residual = rms_norm_ref(x, norm.weight, 1e-5, residual)
        torch.testing.assert_close(new_residual, x + residual, atol=0, rtol=0)
        torch.testing.assert_close(out, norm(x + residual), atol=0, rtol=0)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(silu_and_mul_ref(x), F.silu(x[..., :4]) * x[..., 4:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_hf(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    head_dim, max_position = 16, 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.tensor([0, 5, 63, 17, 2])
    q = torch.randn(5, 4 * head_dim, dtype=dtype)
    k = torch.randn(5, 2, head_dim, dtype=dtype)
    q_out, k_out = apply_rotary_ref(positions, q, k, cache, head_dim)
    emb = torch.cat((freqs, freqs), dim=-1)[positions]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # HF casts cos/sin to the input dtype
    q_hf, k_hf = apply_rotary_pos_emb(
        q.view(5, 4, head_dim).transpose(0, 1), k.transpose(0, 1), cos, sin, unsqueeze_dim=0
    )
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out.view(5, 4, head_dim), q_hf.transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(k_out, k_hf.transpose(0, 1), atol=0, rtol=0)
