"""The Triton kernels against their pure-torch references, on fresh random inputs.

On a CUDA host the kernels run compiled, at larger shapes, in bf16 and fp16. On a CPU-only host
they run in Triton's interpreter at small shapes in fp32 and fp16 (the interpreter gets bf16
dots wrong), in a child pytest of this file started with ``TRITON_INTERPRET=1``
(``test_kernels_in_triton_interpreter``): ``triton.jit`` reads the variable when it decorates a
function, triton's own library functions (``tl.cdiv``...) included, so it must be set before
anything in the process imports triton, which another test module may already have done. Every
output buffer is filled with NaN before the call, so an element a kernel leaves unwritten fails.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from mm_serve import kernels  # noqa: E402
from mm_serve.kernels import triton_activation as _act  # noqa: E402
from mm_serve.kernels import triton_attention as _attn  # noqa: E402
from mm_serve.kernels import triton_cache as _cache  # noqa: E402
from mm_serve.kernels import triton_linear as _linear  # noqa: E402
from mm_serve.kernels import triton_norm as _norm  # noqa: E402
from mm_serve.kernels.attention_metadata import paged_metadata  # noqa: E402
from mm_serve.kernels.triton_attention import launch_config  # noqa: E402

ON_GPU = torch.cuda.is_available()
RUN_KERNELS = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
kernel_test = pytest.mark.skipif(
    not RUN_KERNELS, reason="CPU host: run by test_kernels_in_triton_interpreter"
)
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32, torch.float16]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}


@pytest.mark.skipif(RUN_KERNELS, reason="the kernel tests run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """This file's kernel tests, and ``test_kernels_triton_rotary.py``'s, in a fresh process
    under ``TRITON_INTERPRET=1``."""
    root = Path(__file__).resolve().parents[1]
    files = [__file__, str(Path(__file__).with_name("test_kernels_triton_rotary.py"))]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout, report


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN (an unwritten element) never passes."""
    out, ref = out.double(), ref.double()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return float("inf") if err != err else err


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


# ---------------------------------------------------------------- paged attention


def _shuffled_tables(lengths: list[int], block_size: int, seed: int) -> tuple[list, int]:
    """Non-contiguous block tables for sequences of ``lengths``; returns (tables, num_blocks)."""
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 7
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(n)] for n in need], num_blocks


def _paged_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, pad_rows=2):
    """Random query and paged cache (every slot random) for ``reqs`` = [(cached, new)] with
    shuffled block tables. Returns (query, kv_cache, metadata); query has ``pad_rows`` extra."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _shuffled_tables([c + n for c, n in reqs], block_size, seed)
    kv_cache = _randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    metadata = paged_metadata(reqs, tables, block_size, DEVICE)
    query = _randn(metadata.num_tokens + pad_rows, num_heads, head_dim, dtype=dtype, gen=gen)
    return query, kv_cache, metadata


def _check_attention(reqs, heads, dtype, block_size, seed, config=None) -> None:
    num_heads, num_kv_heads, head_dim = heads
    query, kv_cache, metadata = _paged_batch(
        reqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    out = _nan_like(query)
    _attn.paged_attention_triton(query, kv_cache, metadata, scale, out=out, config=config)
    ref = kernels.paged_attention_ref(query, kv_cache, metadata, scale)
    assert _rel_err(out, ref) <= TOLERANCE[dtype], (reqs, heads, dtype, config)
    assert torch.all(out[metadata.num_tokens :] == 0)


# (cached, new): full prefills, chunks whose cached prefix is not a multiple of the block size,
# decode tokens, a 1-token prefill, a request with nothing scheduled.
MIXED = [(0, 9), (6, 5), (13, 1), (0, 1), (22, 1), (3, 20), (0, 0), (37, 2)]
MIXED_GPU = [(0, 300), (123, 77), (1000, 1), (0, 1), (2049, 1), (45, 130), (0, 0), (511, 17)]
HEADS = [(8, 2, 64), (6, 1, 80), (4, 4, 128)]  # GQA 4, MQA with head dim 80, MHA
HEADS_GPU = [(28, 4, 128), (12, 2, 128), (16, 16, 64), (32, 8, 80), (14, 2, 64)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS_GPU if ON_GPU else HEADS)
def test_paged_attention_mixed_batch(heads, dtype) -> None:
    reqs, block_size = (MIXED_GPU, 16) if ON_GPU else (MIXED, 4)
    _check_attention(reqs, heads, dtype, block_size, seed=len(heads) + heads[2])


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS_GPU[:2] + HEADS_GPU[3:] if ON_GPU else HEADS[:2])
def test_paged_attention_decode_batch(heads, dtype) -> None:
    """Decode-only batch over long contexts, whole and cut into KV segments (flash-decoding) +
    merge; each program takes its request by index (``ONE_QUERY``, the heuristic's choice for
    one query per request) or by the search."""
    if ON_GPU:
        reqs, block_size = [(4095, 1), (3000, 1), (17, 1), (1500, 1)], 16
        configs = [{}, {"NUM_SEGMENTS": 7, "TILE_N": 32}]  # the heuristic splits these too
    else:
        reqs, block_size = [(70, 1), (33, 1), (129, 1)], 4
        configs = [{"NUM_SEGMENTS": 4, "TILE_N": 16}]
    for i, config in enumerate([*configs, {"NUM_SEGMENTS": 1}]):
        for one_query in (True, False):
            _check_attention(reqs, heads, dtype, block_size, i, {**config, "ONE_QUERY": one_query})


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_tile_shapes(dtype) -> None:
    """Prefill chunks with 16- and 64-row query blocks and key tiles that straddle blocks."""
    reqs = [(5, 40), (0, 3), (70, 1)] if not ON_GPU else [(500, 700), (0, 33), (1800, 1)]
    block_size = 4 if not ON_GPU else 32
    for config in ({"BLOCK_M": 16, "TILE_N": 16}, {"BLOCK_M": 64, "TILE_N": 32}):
        _check_attention(reqs, (8, 2, 64), dtype, block_size, seed=3, config=config)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_fp8_cache(dtype) -> None:
    """An FP8 (e4m3) cache (``--kv-cache-dtype fp8``), read in the query's dtype as the
    reference reads it, for a mixed batch and split-KV decodes."""
    reqs, block_size = (MIXED_GPU, 16) if ON_GPU else (MIXED, 4)
    query, kv_cache, metadata = _paged_batch(reqs, 8, 2, 64, block_size, dtype, seed=11)
    kv_cache = kv_cache.to(torch.float8_e4m3fn)
    decodes = paged_metadata([(40, 1), (9, 1)], [list(range(11)), list(range(11, 14))], 4, DEVICE)
    for step, config in ((metadata, None), (decodes, {"NUM_SEGMENTS": 3, "TILE_N": 16})):
        q = query[: step.num_tokens + 2]
        out = _attn.paged_attention_triton(
            q, kv_cache, step, 0.125, out=_nan_like(q), config=config
        )
        ref = kernels.paged_attention_ref(q, kv_cache, step, 0.125)
        assert _rel_err(out, ref) <= TOLERANCE[dtype]


def test_paged_attention_split_is_selected_for_small_decode_batches() -> None:
    cfg = launch_config(7, 1, 4096, 4, 4, torch.device(DEVICE))
    assert cfg["NUM_SEGMENTS"] > 1 and cfg["BLOCK_M"] == 16 and cfg["ONE_QUERY"]
    assert not launch_config(7, 2, 4096, 4, 4, torch.device(DEVICE))["ONE_QUERY"]
    cfg = launch_config(7, 300, 4096, 4, 4, torch.device(DEVICE))
    assert cfg["NUM_SEGMENTS"] == 1 and cfg["BLOCK_M"] == 64 and not cfg["ONE_QUERY"]


# ---------------------------------------------------------------- KV-cache write


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (1, 80), (4, 128)])
def test_reshape_and_cache(num_kv_heads, head_dim, dtype) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size = (64, 16) if ON_GPU else (8, 4)
    num_tokens = 200 if ON_GPU else 12
    # K and V as strided slices of one fused projection, as the model passes them.
    kv = _randn(num_tokens + 3, 2, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens: skipped
    slot_mapping = slots.to(DEVICE)
    kv_cache = _randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    expected = kv_cache.clone()
    _cache.reshape_and_cache_triton(key, value, kv_cache, slot_mapping)
    kernels.reshape_and_cache_ref(key, value, expected, slot_mapping)
    assert torch.equal(kv_cache, expected)
    if not ON_GPU:
        return  # Triton's interpreter rounds to FP8 wrongly (1.948 to 1.0), the GPU does not
    fp8_cache = kv_cache.to(torch.float8_e4m3fn)  # --kv-cache-dtype fp8
    fp8_expected = fp8_cache.clone()
    _cache.reshape_and_cache_triton(key, value, fp8_cache, slot_mapping)
    kernels.reshape_and_cache_ref(key, value, fp8_expected, slot_mapping)
    assert torch.equal(fp8_cache.view(torch.uint8), fp8_expected.view(torch.uint8))


# ---------------------------------------------------------------- RMSNorm, LayerNorm, SiLU-and-mul


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1536, 3584, 1280, 1000] if ON_GPU else [64, 40])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_norm(hidden, dtype, layer_norm) -> None:
    """RMSNorm, or LayerNorm with its bias, alone and with the residual add fused in."""
    gen = torch.Generator().manual_seed(hidden)
    rows = 333 if ON_GPU else 5
    x, residual = (_randn(rows, hidden, dtype=dtype, gen=gen) for _ in range(2))
    x = x + 3.0  # a mean far from 0: LayerNorm must subtract it
    weight, bias = (_randn(hidden, dtype=dtype, gen=gen) for _ in range(2))
    kernel, ref = _norm.rms_norm_triton, kernels.rms_norm_ref
    if layer_norm:
        kernel = functools.partial(_norm.layer_norm_triton, bias=bias)
        ref = functools.partial(kernels.layer_norm_ref, bias=bias)
    out = _nan_like(x)
    kernel(x, weight, eps=1e-6, out=out)
    assert _rel_err(out, ref(x, weight, eps=1e-6)) <= TOLERANCE[dtype]
    out, new_residual = _nan_like(x), _nan_like(x)
    kernel(x, weight, eps=1e-6, residual=residual, out=out, residual_out=new_residual)
    ref_out, ref_residual = ref(x, weight, eps=1e-6, residual=residual)
    assert _rel_err(out, ref_out) <= TOLERANCE[dtype]
    assert torch.equal(new_residual, ref_residual)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8960, 1000] if ON_GPU else [40, 64])
def test_silu_and_mul(d, dtype) -> None:
    gen = torch.Generator().manual_seed(d)
    x = _randn(3, 67 if ON_GPU else 3, 2 * d, dtype=dtype, gen=gen)
    out = torch.full((*x.shape[:-1], d), float("nan"), dtype=dtype, device=DEVICE)
    _act.silu_and_mul_triton(x, out=out)
    assert _rel_err(out, kernels.silu_and_mul_ref(x)) <= TOLERANCE[dtype]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_quick_gelu(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = _randn(67, 5120 if ON_GPU else 129, dtype=dtype, gen=gen) * 3
    out = _act.quick_gelu_triton(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel_err(out, kernels.quick_gelu_ref(x)) <= TOLERANCE[dtype]


# (out_features, in_features, bias): Qwen2-VL-2B's qkv, o, gate_up and down; odd sizes.
GEMV_SHAPES_GPU = [(2048, 1536, True), (1536, 1536, False), (17920, 1536, False),
                   (1536, 8960, False), (1000, 300, True)]  # fmt: skip
GEMV_SHAPES = [(37, 100, True), (16, 64, False), (12, 5000, False)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("shape", GEMV_SHAPES_GPU if ON_GPU else GEMV_SHAPES)
@pytest.mark.parametrize("config", [None, {"BLOCK_N": 8, "BLOCK_K": 32}])
def test_gemv(shape, gated, config, dtype) -> None:
    """One token through a linear layer (with the gated activation fused): the default launch
    config and a small-tile one whose loop over K runs many times."""
    out_features, in_features, bias = shape
    gen = torch.Generator().manual_seed(out_features + in_features)
    x = _randn(1, in_features * (2 if gated else 1), dtype=dtype, gen=gen)
    weight = _randn(out_features, in_features, dtype=dtype, gen=gen) / in_features**0.5
    b = _randn(out_features, dtype=dtype, gen=gen) if bias else None
    out = torch.full((1, out_features), float("nan"), dtype=dtype, device=DEVICE)
    _linear.gemv_triton(x, weight, b, gated, out=out, config=config)
    ref = (kernels.silu_and_mul_linear_ref if gated else kernels.linear_ref)(x, weight, b)
    assert _rel_err(out, ref) <= TOLERANCE[dtype]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", GEMV_SHAPES_GPU[:3] if ON_GPU else GEMV_SHAPES[:2])
def test_rms_norm_gemv(shape, with_residual, dtype) -> None:
    """One token through RMSNorm (+ residual add) and a linear layer in one kernel."""
    out_features, in_features, bias = shape
    gen = torch.Generator().manual_seed(out_features)
    x, residual, norm_weight = (_randn(1, in_features, dtype=dtype, gen=gen) for _ in range(3))
    residual = residual if with_residual else None
    weight = _randn(out_features, in_features, dtype=dtype, gen=gen) / in_features**0.5
    b = _randn(out_features, dtype=dtype, gen=gen) if bias else None
    out, h = _linear.rms_norm_gemv_triton(x, residual, norm_weight, 1e-6, weight, b)
    ref_out, ref_h = kernels.rms_norm_linear_ref(x, residual, norm_weight, 1e-6, weight, b)
    assert _rel_err(out, ref_out) <= TOLERANCE[dtype]
    assert torch.equal(h, ref_h)
