"""Every Triton kernel compiles to a cubin for Ampere (sm_80, sm_86), Ada (sm_89) and Hopper
(sm_90), on this machine without a GPU (Triton compiles for a named target:
``tests/fixtures/triton_targets.py``); with PDL only on Hopper, as the engine launches them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

KERNELS_DIR = Path(__file__).parents[1] / "kernels"
TARGETS = ("80", "86", "89", "90")
FP8_KERNELS = {
    "_quantize_fp8_kernel",
    "_fp8_gemm_kernel",
    "_fp8_gemv_kernel",
}  # FP8 tensor cores: sm_89+


def launched_kernels() -> set[str]:
    """The ``@triton.jit`` functions of ``kernels/`` that a launcher starts (``name[grid](``)."""
    source = "\n".join(path.read_text() for path in KERNELS_DIR.glob("*.py"))
    jitted = set(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)", source))
    launched = set(re.findall(r"^\s*(\w+)\[.*\]\($", source, re.MULTILINE))
    return jitted & launched


def test_every_kernel_compiles_for_each_target():
    command = [sys.executable, "-m", "tests.fixtures.triton_targets", *TARGETS]
    root = Path(__file__).parents[1]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    expected = launched_kernels()
    assert len(expected) >= 9  # silu, gelu, norm, attention, split-KV merge, cache, gemv, ...
    for target in TARGETS:
        compiled, failed = report[target]
        assert failed == {}, (target, failed)
        assert set(compiled) == (expected if target >= "89" else expected - FP8_KERNELS), target
        with_pdl = {name for name, pdl in compiled.items() if pdl}
        if target == "90":
            assert {"_paged_attention_kernel", "_gemv_kernel", "_norm_kernel"} <= with_pdl
        else:
            assert with_pdl == set(), target  # griddepcontrol needs sm_90
