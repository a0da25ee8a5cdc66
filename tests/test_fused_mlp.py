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

from mm_serve.kernels import dispatch, dispatch_linear  # noqa: E402
from mm_serve.kernels import triton_gemm as _gemm  # noqa: E402
from mm_serve.kernels.activation import quick_gelu_ref, silu_and_mul_ref  # noqa: E402
from mm_serve.kernels.rotary import apply_vision_rotary_ref, vision_rotary  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
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
    assert "6 passed" in result.stdout, result.stdout[-3000:]


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


@pytest.mark.skipif(not (HOPPER or INTERPRET), reason="needs an sm90+ GPU or the interpreter")
@pytest.mark.parametrize("has_bias", [False, True])
def test_fused_rotary_matches_linear_then_vision_rotary(has_bias, monkeypatch) -> None:
    """The qkv GEMM with the vision rotary in its epilogue against ``F.linear`` then
    ``apply_vision_rotary_ref``: Qwen2-VL-2B's 16 heads of 80 on the GPU (3 heads per tile),
    4 heads of 10 in the interpreter; a tile straddles k and v on both."""
    rows, heads, head_dim = (4100, 16, 80) if HOPPER else (70, 4, 10)
    dtype = torch.bfloat16 if HOPPER else torch.float32
    if not HOPPER:
        monkeypatch.setitem(_gemm.CONFIGS, _gemm.VISION_ROTARY, (32, 32, 32, 2, 4))
    dim, gen = heads * head_dim, torch.Generator().manual_seed(int(has_bias))
    x = torch.randn(rows, dim, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(3 * dim, dim, generator=gen) / dim**0.5).to(DEVICE, dtype)
    bias = torch.randn(3 * dim, generator=gen).to(DEVICE, dtype) if has_bias else None
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 50
    cos, sin = (f(angles).repeat(1, 2).to(DEVICE) for f in (torch.cos, torch.sin))
    rotary = vision_rotary(cos, sin)
    out = _gemm.linear_act_triton(
        x, weight, bias, _gemm.VISION_ROTARY, (rotary.table, head_dim, 2 * dim)
    )
    q, k, v = F.linear(x, weight, bias).view(rows, 3, heads, head_dim).unbind(1)
    ref = torch.stack(
        [apply_vision_rotary_ref(q, cos, sin), apply_vision_rotary_ref(k, cos, sin), v], 1
    )
    err = (out.float() - ref.flatten(1).float()).abs().max() / ref.float().abs().max()
    assert err <= TOLERANCE[dtype], err


@pytest.mark.skipif(not HOPPER, reason="the fused GEMM serves sm90+ GPUs only")
def test_dispatch_takes_the_fused_gemm_for_large_steps_only() -> None:
    """Large steps get the fused kernel and the same result as cuBLAS plus the activation;
    a decode batch keeps cuBLAS."""
    weight = torch.randn(2 * 8960, 1536, device="cuda", dtype=torch.bfloat16) / 40
    for rows, fused in [(2048, True), (256, False)]:
        x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
        assert dispatch_linear._fused_gemm_fits(x, weight, "silu_and_mul") is fused
        out = dispatch_linear.linear_silu_and_mul(x, weight)
        unfused = dispatch.silu_and_mul(F.linear(x, weight))
        assert (out.float() - unfused.float()).abs().max() <= 1e-2 * unfused.abs().max()


def test_dispatch_runs_the_references_on_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*s, generator=gen) for s in [(5, 8), (12, 8), (12,)])
    y = F.linear(x, weight, bias)
    assert torch.equal(dispatch_linear.linear_silu_and_mul(x, weight, bias), silu_and_mul_ref(y))
    assert torch.equal(dispatch_linear.linear_quick_gelu(x, weight, bias), quick_gelu_ref(y))
    angles = torch.rand(5, 1, generator=gen)  # q, k, v of one head of 2: one angle per row
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    q, k, v = dispatch_linear.linear_vision_rotary(
        x, weight[:6], bias[:6], vision_rotary(cos, sin), 1
    )
    ref = F.linear(x, weight[:6], bias[:6]).view(5, 3, 1, 2)
    assert torch.equal(q, apply_vision_rotary_ref(ref[:, 0], cos, sin))
    assert torch.equal(k, apply_vision_rotary_ref(ref[:, 1], cos, sin)) and torch.equal(
        v, ref[:, 2]
    )


@pytest.mark.skipif(not HOPPER, reason="the fused GEMM serves sm90+ GPUs only")
def test_steps_through_the_fused_mlp_match_hf(model_path, hf_reference) -> None:
    """A first step of 1,090 prompt tokens (over ``FUSED_GEMM_MIN_ROWS``) in the default engine
    (compiled, CUDA graphs): its gate_up runs the fused GEMM; greedy tokens and logprobs as HF's."""
    from test_llm_vs_hf import check_against_hf, random_prompts

    from mm_serve import LLM

    llm = LLM(model_path)
    prompts = random_prompts(llm.config.model.vocab_size, [600, 450, 40], seed=5)
    check_against_hf(llm, hf_reference(model_path), prompts)


@pytest.mark.skipif(not HOPPER, reason="the fused GEMM serves sm90+ GPUs only")
@torch.inference_mode()
def test_qwen2_vl_tower_through_the_fused_gemms_matches_hf(monkeypatch) -> None:
    """Five photos of 32 x 32 patches (5,120 rows, over ``FUSED_GEMM_MIN_ROWS``) through a
    two-block tower of Qwen2-VL-2B's width in bf16: qkv (with the rotary) and fc1 (with
    QuickGELU) run the fused GEMM. The output is HF's within bf16's tolerance, and that of the
    unfused path (cuBLAS and the separate kernels) within a rounding."""
    from test_vision_towers import Qwen2VisionTransformerPretrainedModel, Qwen2VLVisionConfig

    from mm_serve.encoders.qwen2_vl import Qwen2VisionTransformer

    config = Qwen2VLVisionConfig(depth=2, embed_dim=1280, num_heads=16, hidden_size=1536)
    torch.manual_seed(0)
    hf = Qwen2VisionTransformerPretrainedModel._from_config(config).eval()
    ours = Qwen2VisionTransformer(config).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    hf, ours = hf.to("cuda", torch.bfloat16), ours.to("cuda", torch.bfloat16)
    grid_thw = torch.tensor([[1, 32, 32]] * 5, device="cuda")
    pixel_values = torch.randn(5120, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(5120, 1280, device="cuda", dtype=torch.bfloat16)
    for act, weight in [("vision_rotary", ours.blocks[0].attn.qkv.weight),
                        ("quick_gelu", ours.blocks[0].mlp.fc1.weight)]:  # fmt: skip
        assert dispatch_linear._fused_gemm_fits(x, weight, act)
    fused = ours(pixel_values, grid_thw).float()
    monkeypatch.setattr(
        dispatch_linear,
        "FUSED_GEMM_MIN_ROWS",
        dict.fromkeys(["quick_gelu", "silu_and_mul", "vision_rotary"], 1 << 30),
    )
    unfused = ours(pixel_values, grid_thw).float()
    expected = hf(pixel_values, grid_thw=grid_thw).pooler_output.float()
    scale = expected.abs().max()
    assert scale > 0.1
    assert (fused - unfused).abs().max() <= 1e-2 * scale
    torch.testing.assert_close(fused, expected, atol=3e-2 * scale, rtol=3e-2)
