"""The vision towers' Triton segment attention (``kernels/triton_segment_attention.py``) against
``segment_attention_ref``: equal segments (the unmasked path) and unequal ones, head dims that
are a power of two and that split in two parts (Qwen2-VL's 80, SigLIP's 72), ``v`` a strided
view of a fused qkv output as in the towers.

On a CUDA host the kernel runs compiled at the towers' sizes in bf16 and fp16; on a CPU host in
Triton's interpreter at small sizes in fp32 and fp16, in a child pytest started with
``TRITON_INTERPRET=1`` (see ``tests/test_kernels_triton.py``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from mm_serve.kernels.triton_segment_attention import (  # noqa: E402
    DEFAULT_CONFIG,
    head_dim_parts,
    segment_attention_triton,
)
from mm_serve.kernels.varlen_attention import make_segments, segment_attention_ref  # noqa: E402

ON_GPU = torch.cuda.is_available()
RUN_KERNELS = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
kernel_test = pytest.mark.skipif(
    not RUN_KERNELS, reason="CPU host: run by test_segment_attention_in_triton_interpreter"
)
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32, torch.float16]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}
# (segment bounds, tiles): small tiles in the interpreter, the engine's on the GPU.
EQUAL = ([0, 1024, 2048, 3072], DEFAULT_CONFIG) if ON_GPU else ([0, 64, 128], (32, 32, 4, 1))
UNEQUAL = (
    ([0, 1000, 1729, 1730, 2754], DEFAULT_CONFIG) if ON_GPU else ([0, 37, 100, 101], (32, 16, 4, 1))
)


@pytest.mark.skipif(RUN_KERNELS, reason="the kernel tests run in this process")
def test_segment_attention_in_triton_interpreter() -> None:
    """This file's kernel tests in a fresh process under ``TRITON_INTERPRET=1``."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "matches"]
    cmd.append(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, report


def test_head_dim_parts() -> None:
    assert head_dim_parts(80) == (64, 16)
    assert head_dim_parts(72) == (64, 16)
    assert head_dim_parts(128) == (128, 0)
    assert head_dim_parts(40) == (32, 16)
    assert head_dim_parts(112) == (64, 64)


def test_rejects_a_head_dim_below_16() -> None:
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="head_dim >= 16"):
        segment_attention_triton(q, q, q, torch.tensor([0, 4], dtype=torch.int32), 4)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [80, 72, 64])
@pytest.mark.parametrize("case", [EQUAL, UNEQUAL], ids=["equal", "unequal"])
def test_kernel_matches_the_reference(case, head_dim, dtype) -> None:
    bounds, config = case
    heads = 3
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(bounds[-1], 3, heads, head_dim, generator=gen).to(DEVICE, dtype)
    q, k = qkv[:, 0].contiguous(), qkv[:, 1].contiguous()
    v = qkv[:, 2]  # strided rows, as the towers' fused qkv output gives it
    segments = make_segments(bounds, torch.device(DEVICE), flash=False)
    max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    out = segment_attention_triton(q, k, v, segments.cu_seqlens, max_len, config)
    ref = segment_attention_ref(q.float(), k.float(), v.float(), segments)
    assert out.dtype == dtype and out.shape == q.shape
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= TOLERANCE[dtype], err
