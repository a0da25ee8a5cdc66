"""The quantized linear kernels against their float32 references (``kernels.quant_linear``).

The int4 layout and the weight quantizer run everywhere. The Triton W4A16 GEMM runs compiled on
a CUDA host (bf16, fp16) and in Triton's interpreter on a CPU host (fp16, fp32), in a child
pytest started with ``TRITON_INTERPRET=1`` (see ``test_kernels_triton.py``). The FP8 kernels
need FP8 tensor cores (sm_89+) and run on such a GPU only.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mm_serve.kernels.dispatch_quant import fp8_linear, int4_linear
from mm_serve.kernels.quant_linear import (
    dequantize_int4,
    fp8_linear_ref,
    int4_linear_ref,
    pack_int4,
    quantize_fp8_rows,
    quantize_weight,
    unpack_int4,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = torch.cuda.is_available()
RUN_KERNELS = HAS_TRITON and (ON_GPU or os.environ.get("TRITON_INTERPRET") == "1")
FP8_GPU = ON_GPU and torch.cuda.get_device_capability() >= (8, 9)
kernel_test = pytest.mark.skipif(not RUN_KERNELS, reason="CPU host: run in the interpreter")
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16, torch.float32]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return float("inf") if err != err else err


@pytest.mark.skipif(not HAS_TRITON or RUN_KERNELS, reason="the kernel tests run in this process")
def test_kernels_in_triton_interpreter() -> None:
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout, report


@pytest.mark.parametrize("group_size", [32, 128])
def test_pack_int4_round_trip_and_layout(group_size):
    q = torch.randint(-8, 8, (6, 4 * group_size), dtype=torch.int8)
    packed = pack_int4(q, group_size)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 2 * group_size)
    assert torch.equal(unpack_int4(packed, group_size), q)
    half = group_size // 2  # byte j of a group: feature j low, feature j + half high (plus 8)
    assert packed[2, half + 3].item() == (q[2, group_size + 3] + 8) | (
        (q[2, group_size + half + 3] + 8) << 4
    )


def test_quantize_weight_fp8_rows_and_blocks():
    w = torch.randn(256, 384) * torch.linspace(0.1, 3, 256)[:, None]
    rows = quantize_weight(w, "fp8")
    assert rows["weight_scale"].shape == (256, 1)
    blocks = quantize_weight(w, "fp8", group_size=128, block_rows=128)
    scale = blocks["weight_scale"]
    assert scale.shape == (256, 3) and torch.equal(scale[:128], scale[:1].expand(128, 3))
    assert torch.allclose(scale[128, 1], w[128:, 128:256].abs().max() / 448)
    for q in (rows, blocks):
        deq = q["weight"].float() * q["weight_scale"].repeat_interleave(
            384 // q["weight_scale"].shape[1], dim=1
        )
        assert _rel_err(deq, w) < 0.04  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_weight_int4_groups(symmetric):
    w = torch.randn(64, 256) + (0.0 if symmetric else 0.5)
    q = quantize_weight(w, "int4", group_size=128, symmetric=symmetric)
    assert q["weight"].dtype == torch.int8 and q["weight"].abs().max() <= 8
    assert ("weight_zero_point" in q) == (not symmetric)
    deq = dequantize_int4(q["weight"], q["weight_scale"], q.get("weight_zero_point"), 128)
    assert _rel_err(deq, w) < 0.12  # 16 levels per group
    assert _rel_err(deq, w) > 0.0


def test_dispatch_on_the_cpu_is_the_reference():
    x, w = torch.randn(3, 256), torch.randn(64, 256)
    fp8 = quantize_weight(w, "fp8", group_size=128, block_rows=128)
    got = fp8_linear(x, fp8["weight"], fp8["weight_scale"], None, 128)
    assert torch.equal(got, fp8_linear_ref(x, fp8["weight"], fp8["weight_scale"], None, 128))
    q = quantize_weight(w, "int4", group_size=128, symmetric=False)
    args = (q["weight_scale"], q["weight_zero_point"], 128)
    expected = int4_linear_ref(x, q["weight"], *args)
    assert torch.equal(int4_linear(x, q["weight"], *args), expected)
    assert torch.equal(int4_linear(x, pack_int4(q["weight"], 128), *args), expected)


SHAPES = [(1, 4608, 3584), (16, 512, 1024), (300, 3584, 3584)] if ON_GPU else [(1, 64, 256)]
if not ON_GPU:
    SHAPES.append((20, 96, 512))


@kernel_test
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_linear_triton(rows, out_features, in_features, symmetric, dtype):
    from mm_serve.kernels.triton_quant_linear import int4_gemv_triton, int4_linear_triton

    torch.manual_seed(rows)
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    q = quantize_weight(torch.randn(out_features, in_features), "int4", 128, symmetric=symmetric)
    q = {k: v.to(DEVICE) for k, v in q.items()}
    scale = q["weight_scale"].to(dtype)
    zero, bias = q.get("weight_zero_point"), torch.randn(out_features, device=DEVICE).to(dtype)
    expected = int4_linear_ref(x, q["weight"], scale, zero, 128, bias)
    launches = [int4_linear_triton] + ([int4_gemv_triton] if rows == 1 else [])
    for launch in launches:
        got = launch(x, pack_int4(q["weight"], 128), scale, zero, 128, bias)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        assert _rel_err(got, expected) < (2e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.skipif(not FP8_GPU, reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("group_size", [None, 128])
def test_quantize_fp8_triton_matches_the_reference(group_size):
    from mm_serve.kernels.triton_quant_linear import quantize_fp8_triton

    x = torch.randn(37, 3584, device="cuda").to(torch.bfloat16) * 3
    q, scale = quantize_fp8_triton(x, group_size)
    q_ref, scale_ref = quantize_fp8_rows(x, group_size)
    assert torch.allclose(scale, scale_ref, rtol=1e-6)
    assert (q.float() != q_ref.float()).float().mean() < 1e-3  # rounding at ties of x / scale


@pytest.mark.skipif(not FP8_GPU, reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize(
    "input_group_size,cublas_blocks",
    [(0, False), (None, False), (128, False), (128, True)],
    ids=["w8a16", "per_token", "blocks_triton", "blocks_cublas"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_linear_on_the_gpu(rows, input_group_size, cublas_blocks, dtype):
    blocks = input_group_size == 128
    w = torch.randn(4608, 3584)
    q = quantize_weight(w, "fp8", 128 if blocks else None, 128 if blocks else 1)
    weight, scale = q["weight"].cuda(), q["weight_scale"].cuda()
    block_scales = scale[::128].contiguous() if cublas_blocks else None
    x = torch.randn(rows, 3584, device="cuda").to(dtype)
    bias = torch.randn(4608, device="cuda").to(dtype)
    got = fp8_linear(x, weight, scale, bias, input_group_size, block_scales)
    expected = fp8_linear_ref(x, weight, scale, bias, input_group_size)
    assert got.dtype == dtype and _rel_err(got, expected) < 1e-2
