"""Kernel dispatch: Triton on CUDA, the references on CPU or in ``ref`` mode, FlashAttention's
paged varlen call when importable, the vision tower's equal segments through cuDNN in
power-of-two parts, and a whole tiny LM forward on CUDA against the CPU path.

The inputs come from the kernel tests' builders (``test_kernels_triton``).
"""

from __future__ import annotations

import logging
import sys
import types

import numpy as np
import pytest
import torch
from test_kernels_triton import (
    DTYPES,
    MIXED,
    MIXED_GPU,
    ON_GPU,
    _attn,
    _paged_batch,
    _rel_err,
    _shuffled_tables,
)

from mm_serve.config import KernelConfig
from mm_serve.kernels import dispatch, paged_attention_ref, silu_and_mul_ref, triton_rotary
from mm_serve.kernels.attention_metadata import AttentionMetadata, paged_metadata


def _fake_flash_attn_varlen(
    q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
    causal, block_table,
):  # fmt: skip
    """FlashAttention-2's documented semantics of the paged varlen call, in torch."""
    from mm_serve.kernels.attention import causal_attention_ref, gather_kv_ref

    assert causal and k_cache.shape[1] % 256 == 0
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        (qs, qe), (ks, ke) = cu_seqlens_q[i : i + 2].tolist(), cu_seqlens_k[i : i + 2].tolist()
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        kv = torch.stack((k_cache, v_cache))
        key, value = gather_kv_ref(kv, block_table[i], ke - ks)
        out[qs:qe] = causal_attention_ref(q[qs:qe], key, value, softmax_scale)
    return out


def test_flash_attn_wrapper_passes_cumulative_key_lengths(monkeypatch) -> None:
    from mm_serve.kernels import flash_attention

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = _fake_flash_attn_varlen
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    flash_attention.flash_attn_varlen.cache_clear()
    try:
        query, kv_cache, metadata = _paged_batch(
            [(300, 1), (0, 5), (511, 3)], 8, 2, 64, 256, DTYPES[-1], seed=5
        )
        assert flash_attention.flash_attn_unusable_reason(query, kv_cache) is None
        out = flash_attention.paged_attention_flash(query, kv_cache, metadata, 0.125)
        torch.testing.assert_close(out, paged_attention_ref(query, kv_cache, metadata, 0.125))
        assert "256" in flash_attention.flash_attn_unusable_reason(query, kv_cache[:, :, :16])
    finally:
        flash_attention.flash_attn_varlen.cache_clear()


def test_cpu_dispatch_runs_the_references(monkeypatch) -> None:
    from mm_serve import kernels

    monkeypatch.setattr(
        "mm_serve.kernels.config._config", KernelConfig(mode="triton")
    )  # no effect on CPU tensors
    cpu = torch.device("cpu")
    query, kv_cache, metadata = _paged_batch(MIXED, 8, 2, 16, 4, torch.float32, seed=1)
    query, kv_cache = query.to(cpu), kv_cache.to(cpu)
    fields = vars(metadata).items()
    metadata = AttentionMetadata(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in fields})
    assert torch.equal(
        kernels.paged_attention(query, kv_cache, metadata, 0.3),
        paged_attention_ref(query, kv_cache, metadata, 0.3),
    )
    x = torch.randn(4, 32)
    assert torch.equal(kernels.silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_dispatch_uses_triton_and_honours_ref_mode(monkeypatch, caplog) -> None:
    from mm_serve import kernels

    query, kv_cache, metadata = _paged_batch(MIXED_GPU, 28, 4, 128, 16, torch.bfloat16, seed=2)
    dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger="mm_serve.kernels.dispatch"):
        out = kernels.paged_attention(query, kv_cache, metadata, 0.1)
        kernels.paged_attention(query, kv_cache, metadata, 0.1)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "Triton" in caplog.records[0].getMessage()
    ref = paged_attention_ref(query, kv_cache, metadata, 0.1)
    assert _rel_err(out, ref) <= 1e-2

    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel ran in ref mode")

    monkeypatch.setattr("mm_serve.kernels.config._config", KernelConfig(mode="ref"))
    monkeypatch.setattr(_attn, "paged_attention_triton", boom)
    assert torch.equal(kernels.paged_attention(query, kv_cache, metadata, 0.1), ref)
    monkeypatch.setenv("MM_SERVE_KERNELS", "bogus")  # the flag's default: checked at start-up
    with pytest.raises(ValueError, match="MM_SERVE_KERNELS"):
        KernelConfig.from_env()


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_linear_uses_the_gemv_for_one_half_precision_token(monkeypatch) -> None:
    from mm_serve import kernels
    from mm_serve.kernels import triton_linear

    calls = []
    gemv = triton_linear.gemv_triton
    monkeypatch.setattr(
        triton_linear, "gemv_triton", lambda *a, **k: calls.append(1) or gemv(*a, **k)
    )
    weight = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    for rows, dtype, used in [
        (1, torch.bfloat16, 1),
        (2, torch.bfloat16, 0),
        (1, torch.float32, 0),
    ]:
        x = torch.randn(rows, 256, device="cuda", dtype=dtype)
        calls.clear()
        out = kernels.silu_and_mul_linear(x, weight.to(dtype))
        ref = kernels.silu_and_mul_linear_ref(x, weight.to(dtype))
        assert len(calls) == used and _rel_err(out, ref) <= 1e-2
    monkeypatch.setattr("mm_serve.kernels.config._config", KernelConfig(mode="ref"))
    calls.clear()
    kernels.linear(torch.randn(1, 128, device="cuda", dtype=torch.bfloat16), weight)
    assert not calls


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_on_cuda_matches_cpu(tmp_path, dtype, monkeypatch) -> None:
    """The whole LM forward (Triton norm, rotary, cache write, attention, SiLU) on CUDA against
    the same checkpoint on the CPU path: a prefill step, then decodes beside a chunk, then one
    token alone (the GEMV linears in bf16). On CUDA the metadata carries the prefill split the
    model runner plans: in bf16 the first step's fresh prompts go through FlashAttention-2."""
    from mm_serve.config import EngineArgs
    from mm_serve.kernels import varlen_attention
    from mm_serve.models.loader import load_model
    from tests.fixtures.checkpoints import build_tiny_checkpoint

    split_calls = []
    split = varlen_attention.paged_attention_split
    monkeypatch.setattr(
        varlen_attention,
        "paged_attention_split",
        lambda *a, **k: split_calls.append(1) or split(*a, **k),
    )

    path = build_tiny_checkpoint(tmp_path / "llama", "llama", seed=0, head_dim=32)
    steps = [[(0, 12), (0, 1), (0, 30)], [(12, 1), (1, 7), (30, 1)], [(13, 1)]]
    block_size = 16
    tables, num_blocks = _shuffled_tables([13, 8, 31], block_size, seed=4)
    logits = {}
    for device in ("cpu", "cuda"):
        config = EngineArgs(model=path, dtype=dtype, device=device).create_engine_config().model
        model = load_model(config, device)
        shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        nan = torch.full(shape, float("nan"), dtype=config.dtype, device=device)
        model.bind_kv_cache([nan.clone() for _ in range(config.num_layers)])
        gen = torch.Generator().manual_seed(0)
        logits[device] = []
        for reqs in steps:
            metadata = paged_metadata(reqs, tables[: len(reqs)], block_size, device)
            if device == "cuda":
                metadata.prefill_split = varlen_attention.plan_prefill_split(
                    np.array(metadata.query_start_loc_cpu),
                    np.array(metadata.seq_lens_cpu),
                    metadata.block_table.cpu().numpy(),
                    metadata.slot_mapping.cpu().numpy(),
                    metadata.block_table.device,
                )
            ids = torch.randint(0, config.vocab_size, (metadata.num_tokens,), generator=gen)
            positions = torch.cat([torch.arange(c, c + n) for c, n in reqs])
            with torch.inference_mode():
                hidden = model(ids.to(device), positions.to(device), metadata)
                logits[device].append(model.compute_logits(hidden).float().cpu())
    tol = 1e-3 if dtype == "float32" else 3e-2
    for cuda, cpu in zip(logits["cuda"], logits["cpu"], strict=True):
        assert _rel_err(cuda, cpu) <= tol
    # One split call per layer in the first step (fp32 is not FlashAttention's: Triton alone).
    assert len(split_calls) == (0 if dtype == "float32" else config.num_layers)


def test_dense_parts_are_powers_of_two_within_the_cap() -> None:
    from mm_serve.kernels.varlen_attention import MAX_DENSE_BATCH, dense_parts

    assert dense_parts(27) == [16, 8, 2, 1]
    assert dense_parts(40) == [16, 16, 8]
    for count in range(1, 70):
        parts = dense_parts(count)
        assert sum(parts) == count and parts == sorted(parts, reverse=True)
        assert all(p <= MAX_DENSE_BATCH and p & (p - 1) == 0 for p in parts)


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("num_images", [1, 3, 27])
@pytest.mark.parametrize("dense", [True, False])
def test_vision_attention_of_equal_segments_matches_the_reference(num_images, dense) -> None:
    """Same-size images go to cuDNN in power-of-two parts (not ``dense``: FlashAttention-2's
    varlen kernel); every image attends to itself only."""
    from mm_serve.kernels import varlen_attention as varlen

    length, heads, head_dim = 256, 16, 80
    bounds = [i * length for i in range(num_images + 1)]
    gen = torch.Generator().manual_seed(num_images)
    q, k, v = (
        torch.randn(bounds[-1], heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
        for _ in range(3)
    )
    segments = dispatch.varlen_segments(bounds, q.device, q.dtype, dense)
    assert segments.dense == (dense and varlen.has_dense_cudnn(q.device))
    out = dispatch.varlen_attention(q, k, v, segments)
    ref_segments = varlen.make_segments(bounds, q.device, flash=False)
    ref = varlen.segment_attention_ref(q.float(), k.float(), v.float(), ref_segments)
    assert _rel_err(out.float(), ref) < 2e-2


def test_per_step_integers_are_no_specialisation_keys() -> None:
    """A step's request count, block-table width and token count (the M-RoPE positions' axis
    stride) change from step to step. As specialisation keys (== 1, divisible by 16) they made
    Triton compile new variants while serving, on the first step whose count was a multiple
    of 16."""
    kernels = {
        _attn._paged_attention_kernel: {"num_reqs", "stride_bt"},
        triton_rotary._rotary_kernel: {"stride_pos_axis"},
    }
    for kernel, names in kernels.items():
        assert {p.name for p in kernel.params if p.do_not_specialize} == names
