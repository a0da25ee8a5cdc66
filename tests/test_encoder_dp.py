"""Encoder data parallelism under TP (``worker.encoder_dp``, ``mm_encoder_tp_mode="data"``).

The split by hand (``assign_images``); ``DataParallelTower`` on two gloo processes against the
tower over every image; which models it wraps; and the engine at TP=2 on CPU (gloo) with the
split against one rank and HF for Qwen2-VL, Qwen2.5-VL and Qwen3-VL (DeepStack), with the
encoder cache and the prefix cache on: a batch of images of different sizes (an uneven split),
the same batch again (prefix-cache hits), and one image alone (fewer images than ranks);
Qwen3-VL videos beside images (the default mode, "data").
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mm_serve.config import EngineArgs
from mm_serve.distributed import parallel_state
from mm_serve.models.loader import load_model
from mm_serve.worker.encoder_dp import DataParallelTower, assign_images, shard_tower_over_ranks
from tests.fixtures import family_checks as checks
from tests.fixtures.images import generated, mixed_batch, photo
from tests.fixtures.qwen_video_cases import assert_matches_hf as assert_video_batch_matches_hf
from tests.fixtures.qwen_video_cases import mixed_video_batch, qwen3_hf_greedy, shapes_clip
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

TAG = "<|vision_start|><|image_pad|><|vision_end|>"
MERGE, WIDTH = 2, 3
# Images of different sizes (t, h, w patches), then fewer images than ranks.
GRID_CASES = [[[1, 4, 4], [1, 2, 2], [2, 4, 6], [1, 8, 2], [1, 2, 4]], [[1, 4, 6]]]


def test_assign_images_balances_largest_first() -> None:
    """Largest first onto the least-loaded rank, the lowest on a tie; indices ascending."""
    assert assign_images([16, 4, 48, 16, 8], 2) == [[2], [0, 1, 3, 4]]
    assert assign_images([10, 10, 10], 2) == [[0, 2], [1]]
    assert assign_images([5], 3) == [[0], [], []]
    assert assign_images([], 2) == [[], []]
    shares = assign_images([7, 3, 9, 1, 4, 4, 8], 3)
    assert sorted(i for share in shares for i in share) == list(range(7))
    loads = [sum([7, 3, 9, 1, 4, 4, 8][i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= 9  # no rank above another by more than the largest


def _fake_tower(log: list[list[list[int]]]):
    """A tower whose row ``k`` of an image is the sum of its patches ``4k .. 4k + 3``
    (``[patches, WIDTH] -> [patches // MERGE**2, WIDTH]``), logging the grids it gets."""

    def tower(pixel_values: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        assert pixel_values.shape[0] == sum(t * h * w for t, h, w in grids)
        log.append(grids)
        return pixel_values.reshape(-1, MERGE**2, WIDTH).sum(1)

    return tower


def _rank_main(rank: int, rendezvous: str, out: str) -> None:
    """Rank ``rank`` of 2: the wrapped tower over each of ``GRID_CASES``, saved to ``out``."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    parallel_state.init_tensor_parallel(rank, 2)
    results = []
    for grids in GRID_CASES:
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), WIDTH, generator=_seeded())
        log: list = []
        got = DataParallelTower(_fake_tower(log), MERGE, WIDTH)(pixels, grids)
        results.append((got, _fake_tower([])(pixels, grids), log))
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_data_parallel_tower_equals_the_whole_tower_on_every_rank(tmp_path: Path) -> None:
    """Two gloo ranks: each gets the rows of every image in order, equal to the tower over
    all of them, and each image is encoded by exactly one rank (one rank idles when there is
    a single image)."""
    out = str(tmp_path / "result")
    mp.spawn(_rank_main, args=(str(tmp_path / "rendezvous"), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for case, grids in enumerate(GRID_CASES):
        encoded = []
        for results in ranks:
            got, expected, log = results[case]
            assert torch.equal(got, expected)
            encoded += [grid for call in log for grid in call]
        assert sorted(encoded) == sorted(grids)
    assert [len(results[1][2]) for results in ranks] == [1, 0]


def test_only_the_qwen_vl_towers_are_wrapped(
    tmp_path: Path, llama_path: str, monkeypatch, caplog
) -> None:
    """At two ranks "data" wraps Qwen2-VL's tower, leaves LLaVA's (no ``tower_runner``: it
    says so) and a text model; "weights", or one rank, wraps nothing."""
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelState(0, 2))
    models = {}
    for family in ("qwen2_vl", "llava"):
        path = build_tiny_vlm_checkpoint(tmp_path / family, family, seed=0)
        models[family] = load_model(EngineArgs(model=path).create_engine_config().model, "cpu")
    text = load_model(EngineArgs(model=llama_path).create_engine_config().model, "cpu")
    assert not shard_tower_over_ranks(models["qwen2_vl"], "weights")
    with caplog.at_level(logging.INFO, logger="mm_serve.worker.encoder_dp"):
        assert not shard_tower_over_ranks(text, "data")
        assert caplog.records == []
        assert not shard_tower_over_ranks(models["llava"], "data")
        assert "LlavaForConditionalGeneration encodes every image" in caplog.text
    assert shard_tower_over_ranks(models["qwen2_vl"], "data")
    assert isinstance(models["qwen2_vl"].tower_runner, DataParallelTower)
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelState(0, 1))
    assert not shard_tower_over_ranks(models["qwen2_vl"], "data")


def test_unknown_mode_is_refused(tmp_path: Path) -> None:
    path = build_tiny_vlm_checkpoint(tmp_path, "qwen2_vl", seed=0)
    with pytest.raises(ValueError, match="mm_encoder_tp_mode is one of"):
        EngineArgs(model=path, mm_encoder_tp_mode="pipeline").create_engine_config()


def _cases():
    several = [generated(301, 87, 1), generated(23, 45, 2), photo("astronaut.png")]
    return mixed_batch(
        describe=f"{TAG}Describe the image.",
        compare=f"Compare {TAG} with {TAG} and {TAG} please.",
        several=several,
        what=f"{TAG}What is here?",
    )


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_tp2_encoder_data_parallel_matches_tp1_and_hf(family: str, tmp_path: Path) -> None:
    """TP=2 with the images split over the ranks: greedy tokens and top-5 log-probs equal
    HF's, the tokens equal one rank's; the repeated batch hits the prefix cache."""
    path = build_tiny_vlm_checkpoint(tmp_path, family, seed=3)
    reference = checks.HFReference.load(path, nested_images=False)
    cases, alone = _cases(), [(f"{TAG}Describe the image.", [generated(40, 64, 5)])]
    args = {"device": "cpu", "max_model_len": 1024, "num_kv_blocks": 256, "block_size": 4}
    with checks.running_llm(path, **args) as tp1:
        expected = [o.outputs[0].token_ids for o in checks.assert_matches_hf(tp1, reference, cases)]
    with checks.running_llm(path, tensor_parallel_size=2, mm_encoder_tp_mode="data", **args) as llm:
        assert llm.config.multimodal.mm_encoder_tp_mode == "data"
        for _ in range(2):  # the second time from the prefix cache
            outputs = checks.assert_matches_hf(llm, reference, cases)
            assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.get_stats().prefix_cache_hits > 0
        checks.assert_matches_hf(llm, reference, alone)


def test_tp2_encoder_data_parallel_qwen3_vl_videos_match_hf(tmp_path: Path) -> None:
    """Qwen3-VL videos next to images at TP=2 with the split: a video's text rows are
    embedded through the vocab-parallel embedding (an all-reduce) on every rank after the
    gather, so the ranks stay in step; greedy tokens and top-5 log-probs equal HF's."""
    path = build_tiny_vlm_checkpoint(tmp_path, "qwen3_vl", seed=5)
    reference = checks.HFReference.load(path, nested_images=False)
    batch = mixed_video_batch(shapes_clip(tmp_path))
    args = {"device": "cpu", "max_model_len": 2048, "num_kv_blocks": 512}
    with checks.running_llm(path, tensor_parallel_size=2, mm_encoder_tp_mode="data", **args) as llm:
        assert llm.config.multimodal.mm_encoder_tp_mode == "data"
        assert_video_batch_matches_hf(llm, reference, batch, qwen3_hf_greedy)
