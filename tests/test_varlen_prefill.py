"""Fresh prefills through FlashAttention-2's varlen kernel (torch's), the other rows through the
paged kernel.

On the CPU: which rows go where (``plan_prefill_split``), and the split path with a stand-in
for ``aten._flash_attention_forward`` (looked up where the real one is) giving the reference's
output. On CUDA: the real kernel and the Triton kernel through the dispatcher, against
``paged_attention_ref``.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch
from test_kernels_triton import ON_GPU, _rel_err, _shuffled_tables

from mm_serve import kernels
from mm_serve.config import KernelConfig
from mm_serve.kernels import dispatch, paged_attention_ref, reshape_and_cache_ref
from mm_serve.kernels import varlen_attention as varlen
from mm_serve.kernels.attention import causal_attention_ref
from mm_serve.kernels.attention_metadata import paged_metadata

# (cached, new) in the engine's batch order: decode rows of running requests first, then a
# fresh prefill, a later chunk of a prompt, a one-token prompt, a prefix-cache hit, a fresh one.
BATCH = [(20, 1), (7, 1), (0, 9), (8, 6), (0, 1), (4, 5), (0, 12)]
FRESH = [2, 6]  # the requests the varlen kernel serves alone
BATCH_GPU = [(400, 1), (399, 1), (0, 310), (256, 60), (0, 1), (16, 290), (0, 4096), (0, 7)]


def _step(reqs, heads, block_size, dtype, device, seed=0):
    """One step's query, cache (with this step's K/V written) and fresh K/V; ``value`` is a
    strided view of a fused tensor, as the layers pass it. Metadata carries the split plan."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _shuffled_tables([c + n for c, n in reqs], block_size, seed)
    metadata = paged_metadata(reqs, tables, block_size, device)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(device, dtype)
    num_tokens = metadata.num_tokens
    query = torch.randn(num_tokens + 2, num_heads, head_dim, generator=gen).to(device, dtype)
    fused = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    key, value = fused[:, 0], fused[:, 1]
    kernels.reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
    metadata.prefill_split = varlen.plan_prefill_split(
        np.array(metadata.query_start_loc_cpu),
        np.array(metadata.seq_lens_cpu),
        metadata.block_table.cpu().numpy(),
        metadata.slot_mapping.cpu().numpy(),
        torch.device(device),
    )
    return query, key, value, kv_cache, metadata


def _reference_flash_forward(
    query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    return_debug_mask, *, scale=None,
):  # fmt: skip
    """``aten._flash_attention_forward``'s varlen contract (its leading positional arguments,
    output first), computed with the reference per sequence."""
    assert is_causal and dropout_p == 0.0 and not return_debug_mask
    assert torch.equal(cum_seq_q, cum_seq_k) and max_q == max_k
    out = torch.empty_like(query)
    bounds = cum_seq_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        assert end - start <= max_q
        out[start:end] = causal_attention_ref(
            query[start:end], key[start:end], value[start:end], scale
        )
    return out, None, None, None, None


@pytest.fixture
def stand_in_flash(monkeypatch):
    """``torch.ops.aten._flash_attention_forward`` (where the real kernel is looked up)
    replaced by ``_reference_flash_forward``."""
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _reference_flash_forward)


def test_plan_sends_fresh_prefills_to_varlen_and_the_rest_to_the_paged_kernel() -> None:
    query_lens, seq_lens = np.array([n for _, n in BATCH]), np.array([c + n for c, n in BATCH])
    assert np.nonzero(varlen.varlen_requests(query_lens, seq_lens))[0].tolist() == FRESH
    _, _, _, _, metadata = _step(BATCH, (4, 2, 16), 4, torch.float32, "cpu")
    split = metadata.prefill_split
    # Rows of requests 0, 1 (decode), 3 (rows 11-16), 4 (row 17), 5 (rows 18-22).
    assert split.paged_rows.tolist() == [0, 1, *range(11, 17), 17, *range(18, 23)]
    sub = split.paged_metadata
    assert (sub.num_reqs, sub.num_tokens) == (5, 14)
    assert sub.query_start_loc_cpu == [0, 1, 2, 8, 9, 14] == sub.query_start_loc.tolist()
    assert sub.seq_lens_cpu == [21, 8, 14, 1, 9] == sub.seq_lens.tolist()
    assert (sub.max_query_len, sub.max_seq_len) == (6, 21)
    keep = [0, 1, 3, 4, 5]
    assert torch.equal(sub.block_table, metadata.block_table[keep])
    assert torch.equal(sub.slot_mapping, metadata.slot_mapping[split.paged_rows])


def test_plan_of_decode_only_and_all_fresh_steps() -> None:
    plan = functools.partial(
        varlen.plan_prefill_split, block_table=np.zeros((3, 2)), device=torch.device("cpu")
    )
    decode = plan(np.array([0, 1, 2, 3]), np.array([5, 1, 9]), slot_mapping=np.arange(3))
    assert decode is None  # the CUDA graphs' steps: the paged kernel alone
    fresh = plan(np.array([0, 4, 4, 9]), np.array([4, 0, 5]), slot_mapping=np.arange(9))
    assert fresh.paged_rows is None and fresh.paged_metadata is None


def test_split_path_matches_the_reference(stand_in_flash) -> None:
    heads = (4, 2, 16)
    query, key, value, kv_cache, metadata = _step(BATCH, heads, 4, torch.float32, "cpu", seed=3)
    ref = paged_attention_ref(query, kv_cache, metadata, 0.3)
    seen = []

    def paged(q, cache, md, scale):
        seen.append(q.shape[0])
        return paged_attention_ref(q, cache, md, scale)

    out = varlen.paged_attention_split(query, key, value, kv_cache, metadata, 0.3, paged)
    torch.testing.assert_close(out, ref)
    assert seen == [14] and torch.all(out[metadata.num_tokens :] == 0)


def test_cpu_dispatch_ignores_the_plan(monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("the varlen split ran on the CPU path")

    monkeypatch.setattr(varlen, "paged_attention_split", boom)
    query, key, value, kv_cache, metadata = _step(BATCH, (4, 2, 16), 4, torch.float32, "cpu")
    out = kernels.paged_attention(query, kv_cache, metadata, 0.3, key, value)
    assert torch.equal(out, paged_attention_ref(query, kv_cache, metadata, 0.3))


def test_reference_write_and_fused_value_agree() -> None:
    """The step builder's cache holds exactly the fresh K/V at their slots (its premise)."""
    _, key, value, kv_cache, metadata = _step(BATCH, (4, 2, 16), 4, torch.float32, "cpu")
    again = kv_cache.clone()
    reshape_and_cache_ref(key, value, again, metadata.slot_mapping)
    assert torch.equal(again, kv_cache)


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(12, 2, 128), (28, 4, 128), (16, 16, 64)])
def test_cuda_split_matches_reference(heads, dtype, monkeypatch, caplog) -> None:
    """The real FlashAttention-2 varlen kernel (torch's) for the fresh prefills and the Triton
    kernel for the rest, through the dispatcher, on a mixed, an all-fresh and a decode-only
    step, with a scale that is not the default; the kernel mode ``triton`` keeps the Triton
    kernel alone."""
    assert varlen.has_flash_varlen(), "this torch has no torch.nn.attention.varlen"
    calls = []
    real = varlen.flash_varlen
    monkeypatch.setattr(varlen, "flash_varlen", lambda *a, **k: calls.append(1) or real(*a, **k))
    scale = 0.7 * heads[2] ** -0.5
    dispatch._logged.clear()
    steps = [(BATCH_GPU, 1), ([(0, 300), (0, 17), (0, 1000)], 1), ([(90, 1), (3, 1)], 0)]
    for reqs, varlen_calls in steps:
        query, key, value, kv_cache, md = _step(reqs, heads, 16, dtype, "cuda", seed=len(reqs))
        calls.clear()
        with caplog.at_level(logging.INFO, logger="mm_serve.kernels.dispatch"):
            out = kernels.paged_attention(query, kv_cache, md, scale, key, value)
        ref = paged_attention_ref(query, kv_cache, md, scale)
        assert len(calls) == varlen_calls, reqs
        assert _rel_err(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 2e-3), reqs
        assert torch.all(out[md.num_tokens :] == 0)
    assert any("FlashAttention-2 varlen" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr("mm_serve.kernels.config._config", KernelConfig(mode="triton"))
    query, key, value, kv_cache, md = _step(BATCH_GPU, heads, 16, dtype, "cuda")
    calls.clear()
    out = kernels.paged_attention(query, kv_cache, md, scale, key, value)
    assert not calls and _rel_err(out, paged_attention_ref(query, kv_cache, md, scale)) <= 1e-2


def test_engine_splits_only_long_fresh_prompts():
    """The engine's policy (``worth_splitting``): fresh prompts alone, long on average."""
    long = varlen.MIN_VARLEN_PROMPT_LEN
    starts = np.array([0, long, 2 * long])
    assert varlen.worth_splitting(starts, np.array([long, long]))
    assert not varlen.worth_splitting(np.array([0, 315, 630]), np.array([315, 315]))
    # A decode row (cached context) in the step: the Triton kernel alone.
    assert not varlen.worth_splitting(np.array([0, long, long + 1]), np.array([long, 400]))
