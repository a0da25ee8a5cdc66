"""The fused MLP GEMM's epilogues compiled for sm90 on this machine (``benchmarks/
epilogue_sass.py``, no GPU): the packed bf16 rounding takes the scalar conversions off the
conversion unit and leaves the exponentials and reciprocals as they were; the ``.ftz``
exponential takes instructions off besides."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from mm_serve.benchmarks import epilogue_sass  # noqa: E402
from mm_serve.benchmarks.epilogue_cost import MODES  # noqa: E402
from mm_serve.kernels.triton_gemm import QUICK_GELU  # noqa: E402


@pytest.mark.skipif(not os.path.exists(epilogue_sass.NVDISASM), reason="no bundled nvdisasm")
def test_pairs_moves_the_quick_gelu_roundings_off_the_conversion_unit() -> None:
    scalar = epilogue_sass.sass_counts(QUICK_GELU, MODES["ieee"])
    pairs = epilogue_sass.sass_counts(QUICK_GELU, MODES["pairs"])
    assert scalar["F2F"] > 0 and pairs["F2F"] == 0
    assert pairs["MUFU"] == scalar["MUFU"] > 0  # the same ex2 and rcp per element
    assert pairs["F2FP"] > scalar["F2FP"]
    assert sum(pairs.values()) < 1.1 * sum(scalar.values())
    ftz = epilogue_sass.sass_counts(QUICK_GELU, MODES["pairs_ftz"])  # no subnormal scaling
    assert ftz["MUFU"] == scalar["MUFU"] and ftz["F2F"] == 0
    assert sum(ftz.values()) < sum(scalar.values())
