"""The fused MLP GEMM's epilogues compiled for sm90 without a GPU: their instruction mix.

``epilogue_cost`` times the epilogue variants on a GPU; this script shows, on any machine with
Triton, what each compiles to. It builds ``epilogue_cost``'s kernel for each activation and
mode at the engine's tiles, for an sm90 target, disassembles the cubin with the ``nvdisasm``
that Triton bundles, and counts the instructions by opcode. The conversion unit (XU) runs
``MUFU`` (``ex2``, ``rcp``) and the scalar float conversions ``F2F``; the packed ``F2FP`` runs
on the ALU. Static counts of the whole kernel (the epilogue dominates it), not executed ones.

    python -m mm_serve.benchmarks.epilogue_sass [--modes ieee pairs pairs_ftz]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from mm_serve.benchmarks import epilogue_cost
from mm_serve.kernels.triton_gemm import CONFIGS, QUICK_GELU, SILU_AND_MUL

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", re.MULTILINE)


def sass_counts(act: int, mode: int) -> collections.Counter:
    """Opcode counts of ``epilogue_cost``'s kernel for ``act`` and ``mode`` (bf16, with a bias
    for QuickGELU as the tower's ``fc1`` has), compiled for sm90.

    Raises:
        subprocess.CalledProcessError: ``nvdisasm`` failed.
    """
    kernel = epilogue_cost._kernel
    block_m, block_n, block_k, _, warps = CONFIGS[act]
    w_block = f"2, {block_n}, {block_k}" if act == SILU_AND_MUL else f"{block_n}, {block_k}"
    signature = {
        "x_desc": f"tensordesc<bf16[{block_m}, {block_k}]>",
        "w_desc": f"tensordesc<bf16[{w_block}]>",
        "out_desc": f"tensordesc<bf16[{block_m}, {block_n}]>",
        "bias_ptr": "*bf16",
        **dict.fromkeys(("M", "N", "K"), "i32"),
    }
    constants = {
        "ACT": act, "MODE": mode, "HAS_BIAS": act == QUICK_GELU, "BLOCK_M": block_m,
        "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8, "NUM_SMS": 132,
    }  # fmt: skip
    signature.update(dict.fromkeys(constants, "constexpr"))
    names = list(inspect.signature(kernel.fn).parameters)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in ("bias_ptr", "N", "K")}
    source = triton.compiler.ASTSource(kernel, signature, constants, aligned)
    # FP fusion as the GPU's Triton launches it by default (3.9 warns when it is left unset).
    options = {"num_warps": warps, "num_stages": epilogue_cost.STAGES, "enable_fp_fusion": True}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run(
            [NVDISASM, "-c", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    return collections.Counter(OPCODE.findall(sass))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["ieee", "pairs", "pairs_ftz"])
    args = parser.parse_args()
    for act, name in ((QUICK_GELU, "QuickGELU"), (SILU_AND_MUL, "SiLU-and-mul")):
        for mode in args.modes:
            ops = sass_counts(act, epilogue_cost.MODES[mode])
            print(
                f"{name:12s} {mode:6s} {sum(ops.values()):5d} instructions: "
                f"XU {ops['MUFU'] + ops['F2F']} (MUFU {ops['MUFU']}, F2F {ops['F2F']}), "
                f"F2FP {ops['F2FP']}"
            )


if __name__ == "__main__":
    main()
