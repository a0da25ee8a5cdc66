"""``benchmarks/tower_step``'s pieces on the CPU: its unfused form computes the engine's tower,
and its FLOP count is the published tower's (the GPU timing itself is not a test)."""

from __future__ import annotations

import pytest
import torch

from mm_serve.benchmarks import tower_step


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "qwen2.5-vl-7b"])
def test_unfused_form_is_the_engine_tower(name: str) -> None:
    """Two 112x224 images (8 x 16 patches) through the tower, float32 (Qwen2.5-VL's published
    one: window attention and RMSNorm): the fused residual stream (``VisionBlock``) and HF's
    block form give the same embeddings."""
    tower = tower_step.build_tower(name, torch.device("cpu"))
    grids = [[1, 8, 16], [1, 8, 16]]
    pixels = torch.randn(256, tower.patch_embed.proj.weight[0].numel())
    with torch.inference_mode():
        fused = tower(pixels, torch.tensor(grids))
        unfused = tower_step.unfused_run(tower, pixels, grids)
    assert fused.shape == (64, tower.merger.mlp[-1].out_features)
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)


def test_gemm_flops_of_the_qwen2_vl_tower() -> None:
    """Per patch: the patch embedding (1,176 -> 1,280), 32 blocks of qkv, proj, fc1 and fc2
    (1,280 wide, MLP 5,120), and the merger's two layers over a quarter of the rows."""
    tower = tower_step.build_tower("qwen2-vl-2b", torch.device("meta"))
    dim, hidden, merged = 1280, 5120, 1280 * 4
    per_patch = 1176 * dim + 32 * (4 * dim * dim + 2 * dim * hidden)
    per_patch += (merged * merged + merged * 1536) / 4
    assert tower_step.gemm_flops(tower, 1024) == pytest.approx(2 * 1024 * per_patch)
