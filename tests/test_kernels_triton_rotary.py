"""The Triton rotary kernels (RoPE, M-RoPE chunked and interleaved, the vision tower's float32
rotary, RoPE with the KV-cache write fused in) against their references, bit for bit.

Shares ``test_kernels_triton.py``'s set-up: on a CPU-only host its
``test_kernels_in_triton_interpreter`` runs this file in Triton's interpreter too.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from test_kernels_triton import (  # noqa: E402
    DEVICE,
    DTYPES,
    ON_GPU,
    _nan_like,
    _randn,
    _rel_err,
    kernel_test,
)

from mm_serve.kernels import apply_mrotary_ref, apply_rotary_ref, reshape_and_cache_ref  # noqa: E402
from mm_serve.kernels import triton_rotary as _rotary  # noqa: E402


def _rotary_inputs(head_dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_heads, num_kv_heads, max_pos = (300, 28, 4, 4096) if ON_GPU else (7, 3, 2, 64)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)
    # Query and key as strided slices of one fused QKV output; key given as [T, H_kv, d].
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    query, key, _ = qkv.split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], dim=-1)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, max_pos, (3, num_tokens), generator=gen).to(DEVICE)
    return positions, query, key, cache


def _check_rotary(outs, refs) -> None:
    """The kernel rounds each product and sum like the reference: the results are equal."""
    for out, ref in zip(outs, refs, strict=True):
        assert out.shape == ref.shape
        assert torch.equal(out, ref), _rel_err(out, ref)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim,section", [(64, [8, 12, 12]), (80, [8, 16, 16]), (128, [16, 24, 24])]
)
def test_rotary_and_mrope(head_dim, section, dtype) -> None:
    positions, query, key, cache = _rotary_inputs(head_dim, dtype, seed=head_dim)
    outs = (_nan_like(query), _nan_like(key))
    _rotary.apply_rotary_triton(positions[0], query, key, cache, head_dim, out=outs)
    _check_rotary(outs, apply_rotary_ref(positions[0], query, key, cache, head_dim))
    outs = (_nan_like(query), _nan_like(key))
    _rotary.apply_rotary_triton(positions, query, key, cache, head_dim, section, out=outs)
    refs = apply_mrotary_ref(positions, query, key, cache, head_dim, section)
    _check_rotary(outs, refs)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,section", [(32, [6, 5, 5]), (128, [24, 20, 20])])
def test_interleaved_mrope(head_dim, section, dtype) -> None:
    """Qwen3-VL's layout (t h w t h w ...), with the fused KV-cache write too."""
    positions, query, key, cache = _rotary_inputs(head_dim, dtype, seed=head_dim + 1)
    outs = (_nan_like(query), _nan_like(key))
    _rotary.apply_rotary_triton(
        positions, query, key, cache, head_dim, section, out=outs, mrope_interleaved=True
    )
    refs = apply_mrotary_ref(positions, query, key, cache, head_dim, section, interleaved=True)
    _check_rotary(outs, refs)
    chunked = apply_mrotary_ref(positions, query, key, cache, head_dim, section)
    assert not torch.equal(refs[0], chunked[0])  # the layouts differ
    num_tokens, num_kv_heads = key.shape[:2]
    value = _randn(num_tokens, num_kv_heads * head_dim, dtype=dtype, gen=torch.Generator())
    kv_cache = torch.full((2, num_tokens, 1, num_kv_heads, head_dim), float("nan"),
                          dtype=dtype, device=DEVICE)  # fmt: skip
    slots = torch.arange(num_tokens, device=DEVICE)
    q, k = _rotary.apply_rotary_triton(
        positions, query, key, cache, head_dim, section, kv_write=(value, kv_cache, slots),
        mrope_interleaved=True,
    )  # fmt: skip
    _check_rotary((q, k), refs)
    assert torch.equal(kv_cache[0].view(k.shape), k)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mrope", [False, True])
def test_rotary_with_kv_cache_write(mrope, dtype) -> None:
    """RoPE with ``reshape_and_cache`` fused in: the same q/k as without, and the cache as
    ``reshape_and_cache_ref`` writes it (slot -1 skipped, other slots left as they were)."""
    head_dim, section = (128, [16, 24, 24]) if ON_GPU else (16, [2, 3, 3])
    positions, query, key, cache = _rotary_inputs(head_dim, dtype, seed=7)
    positions = positions if mrope else positions[0]
    section = section if mrope else None
    num_tokens, num_kv_heads = key.shape[:2]  # key: [T, H_kv, d]
    gen = torch.Generator().manual_seed(8)
    value = _randn(num_tokens, num_kv_heads * head_dim, dtype=dtype, gen=gen)
    slots = torch.randperm(2 * num_tokens, generator=gen)[:num_tokens].to(DEVICE)
    slots[0] = -1
    kv_cache = torch.full((2, 2 * num_tokens, 1, num_kv_heads, head_dim), float("nan"),
                          dtype=dtype, device=DEVICE)  # fmt: skip
    ref_cache = kv_cache.clone()
    q, k = _rotary.apply_rotary_triton(
        positions, query, key, cache, head_dim, section, kv_write=(value, kv_cache, slots)
    )
    ref_q, ref_k = _rotary.apply_rotary_triton(positions, query, key, cache, head_dim, section)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    heads = (num_tokens, num_kv_heads, head_dim)
    reshape_and_cache_ref(ref_k.view(heads), value.view(heads), ref_cache, slots)
    assert torch.equal(kv_cache.nan_to_num(), ref_cache.nan_to_num())
    assert kv_cache.isnan().sum() == ref_cache.isnan().sum()


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_rotary_in_float32(dtype) -> None:
    """``round_products=False``: float32 arithmetic, only the result rounded (HF's vision
    rotary, as ``kernels.rotary.apply_vision_rotary_ref`` computes it)."""
    from mm_serve.encoders.qwen2_vl import rotary_cos_sin
    from mm_serve.kernels.rotary import apply_vision_rotary_ref as apply_rotary

    gen = torch.Generator().manual_seed(1)
    grids, head_dim, heads = [[1, 4, 6], [2, 2, 2]], 80, 3
    cos, sin = rotary_cos_sin(grids, 2, head_dim, 10000.0, torch.device("cpu"))
    qkv = torch.randn(cos.shape[0], 3, heads, head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.to(DEVICE).unbind(1)  # strided views, as in the tower
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    table = torch.cat([cos[:, : head_dim // 2], sin[:, : head_dim // 2]], dim=-1)
    positions = torch.arange(q.shape[0], device=DEVICE)
    outs = (_nan_like(q), _nan_like(k))
    _rotary.apply_rotary_triton(positions, q, k, table, head_dim, out=outs, round_products=False)
    _check_rotary(outs, (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)))
