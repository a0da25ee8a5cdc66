"""The GEMM with the MLP's activation in its epilogue (``kernels/triton_gemm.py``) against
cuBLAS and the activation kernels, and the dispatch that picks it.

On an sm90+ GPU the kernel runs compiled at Qwen2-VL-2B's shapes in bf16 and fp16. On a CPU
host it runs in Triton's interpreter in fp32 at small shapes and tiles, in a child pytest of
this file started with ``TRITON_INTERPRET=1`` (which must be set before triton is imported).
Every case has rows that are not a multiple of the tile, so the edge tiles are checked too.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mm_serve.kernels import dispatch, dispatch_linear  # noqa: E402
from mm_serve.kernels import triton_gemm as _gemm  # noqa: E402
from mm_serve.kernels.activation import quick_gelu_ref, silu_and_mul_ref  # noqa: E402
from mm_serve.kernels.triton_gemm import round_to  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
AMPERE = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HOPPER else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if HOPPER else [torch.float32]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# (rows, K, N) per activation; N is the output width (the weight has 2 N rows for SiLU-and-mul).
SHAPES = {
    _gemm.QUICK_GELU: (4100, 1280, 5120) if HOPPER else (70, 64, 96),
    _gemm.SILU_AND_MUL: (1100, 1536, 8960) if HOPPER else (70, 64, 48),
}
REFERENCES = {_gemm.QUICK_GELU: quick_gelu_ref, _gemm.SILU_AND_MUL: silu_and_mul_ref}


@pytest.mark.skipif(HOPPER or INTERPRET, reason="the kernel tests run in this process")
def test_kernel_in_triton_interpreter() -> None:
    """This file's kernel tests in a fresh process under ``TRITON_INTERPRET=1``."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "matches"]
    result = subprocess.run([*cmd, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "4 passed" in result.stdout, result.stdout[-3000:]


@pytest.mark.skipif(not (HOPPER or INTERPRET), reason="needs an sm90+ GPU or the interpreter")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("act", [_gemm.QUICK_GELU, _gemm.SILU_AND_MUL])
def test_fused_kernel_matches_linear_then_activation(act, has_bias, dtype, monkeypatch) -> None:
    if not HOPPER:  # tiles small enough for the shapes, few programs: every branch runs
        monkeypatch.setitem(_gemm.CONFIGS, act, (32, 32, 32, 2, 4))
    rows, k, n = SHAPES[act]
    n_weight = 2 * n if act == _gemm.SILU_AND_MUL else n
    gen = torch.Generator().manual_seed(act + 2 * has_bias)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n_weight, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    bias = torch.randn(n_weight, generator=gen).to(DEVICE, dtype) if has_bias else None
    out = _gemm.linear_act_triton(x, weight, bias, act)
    ref = REFERENCES[act](
        F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    )
    assert out.shape == (rows, n) and out.dtype == dtype
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err <= TOLERANCE[dtype], err


@triton.jit
def _round_pairs_kernel(out_ptr, x_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, round_to(tl.load(x_ptr + offs), tl.bfloat16, True))


@pytest.mark.skipif(not AMPERE, reason="cvt.rn.bf16x2.f32 needs an sm80+ GPU")
def test_round_to_bf16_in_pairs_equals_the_conversion() -> None:
    """``round_to(..., PAIRS=True)`` (``cvt.rn.bf16x2.f32``, unpacked) against torch's
    conversion, bit for bit: odd and even positions (a swapped pair would show), ties to even,
    subnormals, the largest finite values, infinities, and NaN as NaN."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)  # every exponent, NaNs and infinities among them
    ties = torch.arange(1, 4097, dtype=torch.float32) * 2.0**-8 + 2.0**-16  # halfway cases
    edge = [0.0, -0.0, 3.4e38, -3.4e38, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-41]
    x = torch.cat([x, ties, -ties, torch.tensor(edge * 4)]).cuda()
    x = torch.nn.functional.pad(x, (0, -x.numel() % 1024))
    out = torch.empty_like(x)
    _round_pairs_kernel[(x.numel() // 1024,)](out, x, BLOCK=1024)
    expected = x.to(torch.bfloat16).float()
    assert torch.equal(out.isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(out[keep].view(torch.int32), expected[keep].view(torch.int32))


@pytest.mark.skipif(not HOPPER, reason="the fused GEMM serves sm90+ GPUs only")
def test_dispatch_takes_the_fused_gemm_for_large_steps_only() -> None:
    """Large steps get the fused kernel and the same result as cuBLAS plus the activation;
    a decode batch keeps cuBLAS."""
    weight = torch.randn(2 * 8960, 1536, device="cuda", dtype=torch.bfloat16) / 40
    for rows, fused in [(2048, True), (256, False)]:
        x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
        assert dispatch_linear._fused_mlp_fits(x, weight, "silu_and_mul") is fused
        out = dispatch_linear.linear_silu_and_mul(x, weight)
        unfused = dispatch.silu_and_mul(F.linear(x, weight))
        assert (out.float() - unfused.float()).abs().max() <= 1e-2 * unfused.abs().max()


def test_dispatch_runs_the_references_on_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*s, generator=gen) for s in [(5, 8), (12, 8), (12,)])
    y = F.linear(x, weight, bias)
    assert torch.equal(dispatch_linear.linear_silu_and_mul(x, weight, bias), silu_and_mul_ref(y))
    assert torch.equal(dispatch_linear.linear_quick_gelu(x, weight, bias), quick_gelu_ref(y))


@pytest.mark.skipif(not HOPPER, reason="the fused GEMM serves sm90+ GPUs only")
def test_steps_through_the_fused_mlp_match_hf(model_path, hf_reference) -> None:
    """A first step of 1,090 prompt tokens (over ``FUSED_MLP_MIN_ROWS``) in the default engine
    (compiled, CUDA graphs): its gate_up runs the fused GEMM; greedy tokens and logprobs as HF's."""
    from test_llm_vs_hf import check_against_hf, random_prompts

    from mm_serve import LLM

    llm = LLM(model_path)
    prompts = random_prompts(llm.config.model.vocab_size, [600, 450, 40], seed=5)
    check_against_hf(llm, hf_reference(model_path), prompts)
