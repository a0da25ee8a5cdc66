"""Paged attention beyond the causal mask: a sliding window and per-row key limits (the tokens of
one image attending to each other, Gemma 3), in the reference and the Triton kernel.

The reference is checked against a dense attention with HF's mask composition for Gemma 3
(``AND(sliding_window, OR(causal, blockwise))``, ``masking_utils``), the Triton kernel against
the reference. The blocks before each request's window are filled with NaN: a kernel that
read them (instead of starting at the window, as the KV-cache manager frees them) fails.

The Triton kernels run compiled on a CUDA host, and on a CPU host in Triton's interpreter, in a
child pytest started with ``TRITON_INTERPRET=1`` (see ``tests/test_kernels_triton.py``).
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mm_serve.kernels import paged_attention_ref
from mm_serve.kernels.attention_metadata import paged_metadata

ON_GPU = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
RUN_KERNELS = HAS_TRITON and (ON_GPU or os.environ.get("TRITON_INTERPRET") == "1")
DEVICE = "cuda" if ON_GPU else "cpu"
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}

# (cached, new, image runs [start, end) in absolute positions inside the request's tokens):
# fresh prefills with images, a chunk after a cached prefix holding an image that starts
# before the chunk (a prefix hit inside an image), decodes, a one-token prefill, an empty row.
REQS = [
    (0, 21, [(3, 12)]),
    (9, 14, [(5, 14), (16, 20)]),
    (30, 1, []),
    (0, 1, []),
    (17, 6, [(18, 22)]),
    (0, 0, []),
    (41, 2, []),
]


def _tables(lengths: list[int], block_size: int, seed: int) -> tuple[list[list[int]], int]:
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 3
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(n)] for n in need], num_blocks


def _batch(heads, block_size, window, dtype, seed=0, images=True):
    """Query, paged cache (blocks before each request's window NaN) and metadata (with
    ``key_end`` from the image runs when ``images``)."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    reqs = [(c, n) for c, n, _ in REQS]
    tables, num_blocks = _tables([c + n for c, n in reqs], block_size, seed)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    for (cached, _), table in zip(reqs, tables, strict=True):
        first = 0 if window is None else max(0, cached - window + 1) // block_size
        cache[:, table[:first]] = float("nan")  # freed: never to be read
    metadata = paged_metadata(reqs, tables, block_size, DEVICE)
    if images:
        key_end = []
        for cached, new, runs in REQS:
            for pos in range(cached, cached + new):
                key_end.append(next((e for s, e in runs if s <= pos < e), pos + 1))
        metadata.key_end = torch.tensor(key_end, dtype=torch.int32, device=DEVICE)
    query = torch.randn(metadata.num_tokens + 2, num_heads, head_dim, generator=gen)
    return query.to(DEVICE, dtype), cache.to(DEVICE, dtype), metadata


def _dense(query, cache, metadata, scale, window, images=True) -> torch.Tensor:
    """Each request's rows against all its keys, with HF's mask for Gemma 3: a key is seen if
    it is not in the future or in the same image (``blockwise_overlay``), and within the
    window (``sliding_window_overlay``: ``k > q - window``)."""
    out = torch.zeros_like(query, dtype=torch.float32)
    starts, block_size = metadata.query_start_loc_cpu, cache.shape[2]
    for i, (cached, new, runs) in enumerate(REQS):
        if not new:
            continue
        seq_len = cached + new
        table = metadata.block_table[i, : -(-seq_len // block_size)].long()
        k, v = (cache[j, table].flatten(0, 1)[:seq_len].float() for j in (0, 1))
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        block_id = torch.full((seq_len,), -1)
        for b, (s, e) in enumerate(runs if images else []):
            block_id[s:e] = b
        q_pos, k_pos = torch.arange(cached, seq_len)[:, None], torch.arange(seq_len)[None, :]
        same_image = (block_id[q_pos] == block_id[k_pos]) & (block_id[q_pos] >= 0)
        seen = (k_pos <= q_pos) | same_image
        if window is not None:
            seen &= k_pos > q_pos - window
        k, v = torch.nan_to_num(k), torch.nan_to_num(v)  # unseen keys only: masked below
        q = query[starts[i] : starts[i + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~seen.to(scores.device), float("-inf"))
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("window", [None, 5, 8])
@pytest.mark.parametrize("images", [True, False], ids=["images", "causal"])
def test_reference_matches_hf_mask(window, images) -> None:
    query, cache, metadata = _batch((4, 2, 16), 4, window, torch.float32, images=images)
    out = paged_attention_ref(query, cache, metadata, 0.3, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _dense(query, cache, metadata, 0.3, window, images))


def test_image_rows_see_later_image_tokens() -> None:
    """The mask matters: without ``key_end`` the image rows differ, the others do not."""
    query, cache, metadata = _batch((4, 2, 16), 4, None, torch.float32)
    with_images = paged_attention_ref(query, cache, metadata, 0.3)
    metadata.key_end = None
    causal = paged_attention_ref(query, cache, metadata, 0.3)
    differs = (with_images - causal).abs().amax(dim=(1, 2)) > 1e-6
    rows = []  # the image rows but each image's last (it sees no later key)
    for (cached, _, runs), first in zip(REQS, metadata.query_start_loc_cpu, strict=False):
        for start, end in runs:
            rows += [first + pos - cached for pos in range(max(start, cached), end - 1)]
    assert differs[rows].all() and differs.sum() == len(rows)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(RUN_KERNELS or ON_GPU, reason="the kernel tests run in this process")
def test_masks_in_triton_interpreter() -> None:
    """This file's Triton tests in a fresh process under ``TRITON_INTERPRET=1``."""
    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "test_triton_matches",
        __file__,
    ]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, report


@pytest.mark.skipif(not RUN_KERNELS, reason="CPU host: run by test_masks_in_triton_interpreter")
@pytest.mark.parametrize("window", [None, 5, 8])
@pytest.mark.parametrize(
    "config",
    [None, {"BLOCK_M": 16, "TILE_N": 16}, {"BLOCK_M": 16, "TILE_N": 16, "NUM_SEGMENTS": 3}],
    ids=["heuristic", "small_tiles", "split_kv"],
)
def test_triton_matches_reference(window, config) -> None:
    from mm_serve.kernels.triton_attention import paged_attention_triton

    dtype = torch.bfloat16 if ON_GPU else torch.float32
    for images in (True, False):
        query, cache, metadata = _batch((8, 2, 16), 4, window, dtype, seed=1, images=images)
        out = torch.full_like(query, float("nan"))
        paged_attention_triton(query, cache, metadata, 0.3, out, config, window)
        ref = paged_attention_ref(query, cache, metadata, 0.3, window)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err <= TOLERANCE[dtype], (window, config, images, err)
        assert torch.all(out[metadata.num_tokens :] == 0)
