"""Which cuBLAS kernel each token count gets, for the LM's linear layers.

CUDA loads a kernel the first time it is launched (lazy loading, the default since CUDA 12),
and loading one may synchronise the context: the host waits until the device has run
everything queued. An eager step whose GEMM shape picks a kernel not launched before then
stalls the engine's launch-ahead. This script lists, for each of the LM's linear shapes
(``[M, K] x [K, N]``, bf16, with its bias where the layer has one), the kernels cuBLAS runs for
every ``M`` in ``1..--max-tokens`` (``1..--max-num-seqs`` for the LM head: the sampled rows),
and whether calling every ``--stride``-th ``M`` launches them all.

    python -m mm_serve.benchmarks.gemm_kernels --model-arch qwen2-vl-2b --max-tokens 8192
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from mm_serve.benchmarks.architectures import ARCHITECTURES, write_architecture

MARKER = "spin"  # torch.cuda._sleep's kernel name holds it: one between two calls


def lm_linear_shapes(text_config) -> dict[str, tuple[int, int, bool]]:
    """``{name: (K, N, has_bias)}`` of a Qwen2/Llama-style LM's linear layers."""
    c = text_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
    return {
        "qkv_proj": (c.hidden_size, qkv, True),
        "o_proj": (c.num_attention_heads * head_dim, c.hidden_size, False),
        "gate_up_proj": (c.hidden_size, 2 * c.intermediate_size, False),
        "down_proj": (c.intermediate_size, c.hidden_size, False),
        "lm_head": (c.hidden_size, c.vocab_size, False),
    }


def kernels_per_m(k: int, n: int, bias: bool, ms: list[int]) -> dict[int, tuple[str, ...]]:
    """``{M: names of the kernels one F.linear call launched}`` (profiled, one marker kernel
    between calls)."""
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.01
    b = torch.zeros(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for m in ms:
            F.linear(x[:m], weight, b)
            torch.cuda._sleep(1)
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    calls, current = [], []
    for event in kernels:
        if MARKER in event.name:
            calls.append(tuple(current))
            current = []
        elif not event.name.startswith("Memset"):
            current.append(event.name)
    return dict(zip(ms, calls, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-arch", choices=sorted(ARCHITECTURES), default="qwen2-vl-2b")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--stride", type=int, nargs="+", default=[8, 16, 64])
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(write_architecture(args.model_arch, tempfile.mkdtemp()))
    for name, (k, n, bias) in lm_linear_shapes(config.get_text_config()).items():
        max_m = args.max_num_seqs if name == "lm_head" else args.max_tokens
        chosen = kernels_per_m(k, n, bias, list(range(1, max_m + 1)))
        first_m: dict[str, int] = {}
        ranges: dict[str, list[int]] = defaultdict(list)
        for m, names in chosen.items():
            for kernel in names:
                first_m.setdefault(kernel, m)
                ranges[kernel].append(m)
        print(f"{name}: K={k} N={n} bias={bias}: {len(first_m)} kernels")
        for kernel, m in sorted(first_m.items(), key=lambda item: item[1]):
            print(f"  first M {m:5d}, {len(ranges[kernel]):5d} Ms: {kernel[:90]}")
        for stride in args.stride:
            swept = {1, *range(stride, max_m + 1, stride)}
            covered = {kernel for m in swept for kernel in chosen[m]}
            missed = sorted(set(first_m) - covered)
            print(f"  every {stride}th M (and 1): misses {len(missed)} kernels")


if __name__ == "__main__":
    main()
