"""Prefill attention on the image workload's shapes: our kernels against cuDNN SDPA and
FlashAttention-2, for ``mm-serve bench kernels`` (:mod:`mm_serve.benchmarks.kernels`).

Qwen2-VL-2B's LM (12 query / 2 KV heads, head dim 128, bf16, block size 16): a prefill chunk
of 26 fresh ~315-token prompts (8,192 tokens), the same after 64 decode rows (context 400), and
one 4,096-token prompt. Methods: the Triton paged kernel and the engine's split
(FlashAttention-2's varlen kernel for fresh prompts + Triton for the rest) on every row; on the
fresh prompts' rows, cuDNN (SDPA padded and per prompt, and its ragged call), torch's
FlashAttention-2 varlen kernel alone and the ``flash_attn`` package where importable. Each
is checked once against ``paged_attention_ref``, then timed.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from mm_serve.benchmarks.kernel_timing import bench, causal_flops, paged_batch, rel_err
from mm_serve.kernels import paged_attention_ref

PREFILL_HEADS = (12, 2, 128)  # Qwen2-VL-2B's LM: query heads, KV heads, head dim


def prefill_cases() -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, [(cached, new)]): a prefill chunk of 26 fresh prompts of 300-330 tokens (256
    image + ~50 text tokens each), 8,192 in all; the same after 64 decode rows of context 400
    (the batch order of the engine: running requests first); one 4,096-token prompt."""
    lens = [300 + (17 * i) % 31 for i in range(25)]
    chunk = [(0, n) for n in lens] + [(0, 8192 - sum(lens))]
    return [
        ("chunk 26x~315", chunk),
        ("chunk 26x~315 + 64 decodes", [(400, 1)] * 64 + chunk),
        ("prompt 1x4096", [(0, 4096)]),
    ]


@dataclasses.dataclass
class Method:
    """One way to compute (some rows of) a case: ``unpack(run())`` gives ``[len(rows), heads,
    head_dim]``, the attention of the batch rows ``rows``; ``ours`` must pass its check."""

    name: str
    rows: torch.Tensor  # [n] int64 batch rows
    run: Callable[[], object]
    unpack: Callable[[object], torch.Tensor] = lambda out: out
    ours: bool = False


@dataclasses.dataclass
class Packed:
    """The fresh prompts of a case packed: their rows, q ``[rows, heads, d]``, k and v ``[rows,
    kv_heads, d]`` (read from the cache at their slots), ``cu_seqlens`` and lengths."""

    rows: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    lens: list[int]


def pack_fresh(q, kv, md, reqs) -> Packed:
    starts = md.query_start_loc_cpu
    fresh = [i for i, (c, n) in enumerate(reqs) if c == 0 and n > 1]
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in fresh]).cuda()
    flat = kv.flatten(1, 2)  # [2, slots, kv_heads, head_dim]
    slots = md.slot_mapping[rows]
    lens = [reqs[i][1] for i in fresh]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    return Packed(rows, q[rows], flat[0, slots], flat[1, slots], cu, lens)


def cudnn_methods(p: Packed, scale: float) -> list[Method]:
    """cuDNN attention on the fresh prompts: SDPA restricted to cuDNN, padded to the longest in
    one batched call (causal masking keeps the padding out of the real rows) and one call per
    prompt, with K/V expanded to every query head beforehand (the kernel's best case: not
    timed); and the ragged (varlen) call ``aten._cudnn_attention_forward``, with the 2 KV heads
    as they are and with the expansion timed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = p.q.shape[1] // p.k.shape[1]
    per_prompt = [  # (q, k, v), each [1, heads, n, head_dim]
        tuple(
            x[start : start + n].repeat_interleave(r, dim=1).transpose(0, 1)[None]
            for x, r in ((p.q, 1), (p.k, group), (p.v, group))
        )
        for start, n in zip(p.cu_seqlens[:-1].tolist(), p.lens, strict=True)
    ]
    longest = max(p.lens)
    padded = [  # q, k, v: [num_prompts, heads, longest, head_dim]
        torch.cat([F.pad(x, (0, 0, 0, longest - x.shape[2])) for x in xs])
        for xs in zip(*per_prompt, strict=True)
    ]
    lens = torch.tensor(p.lens, device="cuda")
    real = (torch.arange(longest, device="cuda") < lens[:, None]).flatten().nonzero()[:, 0]

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    def ragged(k, v):  # the call torch's varlen_attn makes on its (disabled) cuDNN path
        lens = (p.cu_seqlens, p.cu_seqlens, longest, longest)
        attention = torch.ops.aten._cudnn_attention_forward
        return attention(p.q, k, v, None, *lens, True, 0.0, True, False, scale=scale)[0]

    def expanded():  # [rows, heads, head_dim] keys and values: what the engine would pay
        return (x.repeat_interleave(group, dim=1) for x in (p.k, p.v))

    return [
        Method(
            "cuDNN SDPA, padded batch",
            p.rows,
            lambda: sdpa(*padded),
            lambda out: out.transpose(1, 2).flatten(0, 1)[real],
        ),
        Method(
            "cuDNN SDPA, per prompt",
            p.rows,
            lambda: [sdpa(*qkv) for qkv in per_prompt],
            lambda outs: torch.cat([out[0].transpose(0, 1) for out in outs]),
        ),
        Method("cuDNN varlen (ragged), GQA", p.rows, lambda: ragged(p.k, p.v)),
        Method("cuDNN varlen, K/V expanded (timed)", p.rows, lambda: ragged(*expanded())),
    ]


def prefill_methods(q, kv, md, reqs, scale: float) -> list[Method]:
    """The Triton kernel and the engine's split on every row; the others on the fresh rows."""
    from mm_serve.kernels import paged_attention
    from mm_serve.kernels import varlen_attention as varlen
    from mm_serve.kernels.flash_attention import flash_attn_varlen
    from mm_serve.kernels.triton_attention import paged_attention_triton

    host = (np.array(md.query_start_loc_cpu), np.array(md.seq_lens_cpu))
    host += (md.block_table.cpu().numpy(), md.slot_mapping.cpu().numpy())
    split_md = dataclasses.replace(md, prefill_split=varlen.plan_prefill_split(*host, q.device))
    key, value = kv.flatten(1, 2)[:, md.slot_mapping]  # this step's K/V, as the layers pass them
    why_not = varlen.varlen_unusable_reason(q)
    every = torch.arange(md.num_tokens, device="cuda")
    methods = [
        Method(
            "Triton paged kernel",
            every,
            lambda: paged_attention_triton(q, kv, md, scale),
            ours=True,
        ),
        Method(
            "engine: FA2 varlen + Triton" if why_not is None else f"engine ({why_not})",
            every,
            lambda: paged_attention(q, kv, split_md, scale, key, value),
            ours=True,
        ),
    ]
    p = pack_fresh(q, kv, md, reqs)
    methods += cudnn_methods(p, scale)
    args = (p.q, p.k, p.v, p.cu_seqlens)
    if varlen.has_flash_varlen():
        run = lambda: varlen.flash_varlen(*args, max(p.lens), scale)  # noqa: E731
        methods.append(Method("FlashAttention-2 varlen (torch's)", p.rows, run))
    if (flash := flash_attn_varlen()) is not None:
        lens = (p.cu_seqlens, max(p.lens), max(p.lens))
        run = lambda: flash(*args, *lens, softmax_scale=scale, causal=True)  # noqa: E731
        methods.append(Method("flash_attn package, varlen", p.rows, run))
    return methods


def prefill_rows() -> list[dict]:
    """Every method on every prefill case: checked against the reference once, then timed."""
    heads = PREFILL_HEADS
    rows = []
    for case, reqs in prefill_cases():
        q, kv, md = paged_batch(reqs, heads, 16, torch.bfloat16)
        scale = heads[2] ** -0.5
        ref = paged_attention_ref(q, kv, md, scale)
        fresh = [(c, n) for c, n in reqs if c == 0 and n > 1]
        for m in prefill_methods(q, kv, md, reqs, scale):
            every = len(m.rows) == md.num_tokens
            row = {"case": case, "method": m.name, "rows": "all" if every else "fresh prompts"}
            try:
                err = rel_err(m.unpack(m.run()), ref[m.rows])
                if err > 2e-2:
                    raise AssertionError(f"{case}, {m.name}: relative error {err:.3g}")
                ms = bench(m.run)
            except Exception as exc:  # another library's kernel that does not run here
                if m.ours:
                    raise
                rows.append({**row, "error": repr(exc)[:300]})
                continue
            flops = causal_flops(reqs if every else fresh, heads)
            rows.append({**row, "ms": ms, "TFLOPs": flops / ms / 1e9, "rel_err": err})
    return rows


def print_prefill(rows: list[dict]) -> None:
    num_heads, num_kv_heads, head_dim = PREFILL_HEADS
    print(f"prefill attention: {num_heads}/{num_kv_heads} heads, head dim {head_dim}, bf16, "
          "block size 16 (Qwen2-VL-2B LM)")  # fmt: skip
    print(f"{'case':27} {'method':38} {'rows':>13} {'ms':>7} {'TFLOP/s':>8} {'rel err':>8}")
    for r in rows:
        head = f"{r['case']:27} {r['method'][:38]:38} {r['rows']:>13}"
        if "error" in r:
            print(f"{head} failed: {r['error'][:80]}")
        else:
            print(f"{head} {r['ms']:7.3f} {r['TFLOPs']:8.1f} {r['rel_err']:8.1e}")
