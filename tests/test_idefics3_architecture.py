"""The weightless SmolVLM folders of ``mm-serve bench --model-arch``: HF's model and ours have
the same parameters (about the published sizes), and our processor gives HF's pixels and
prompt expansion on the published tiling (512- and 384-pixel tiles, 64 and 81 tokens each)."""

from __future__ import annotations

import pytest
import torch

from mm_serve.encoders.processors import get_image_processor
from tests.fixtures import family_checks as checks
from tests.fixtures.checkpoints import write_architecture
from tests.fixtures.images import photo


@pytest.mark.parametrize(
    ("name", "millions", "tile_tokens"),
    [("smolvlm-256m", 228, 64), ("smolvlm-2.2b", 2246, 81)],
    ids=["256m", "2.2b"],
)
def test_smolvlm_architecture(tmp_path, name, millions, tile_tokens) -> None:
    from transformers import AutoConfig, AutoProcessor, Idefics3ForConditionalGeneration

    from mm_serve.models.idefics3 import Idefics3ForConditionalGeneration as Ours

    folder = write_architecture(name, tmp_path)
    config = AutoConfig.from_pretrained(folder)
    counts = checks.meta_parameter_counts(config, Idefics3ForConditionalGeneration, Ours)
    assert counts[0] == counts[1] and counts[0] // 10**6 == millions
    image = photo("grace_hopper.jpg")
    hf = AutoProcessor.from_pretrained(folder)(
        text=["<image>"], images=[[image]], return_tensors="pt", add_special_tokens=False
    )
    ours = get_image_processor(folder, config).preprocess(image)
    assert torch.equal(ours.pixel_values, hf["pixel_values"][0])
    assert list(ours.token_ids) == hf["input_ids"][0].tolist()
    assert ours.num_tokens == len(ours.token_ids)
    assert list(ours.token_ids).count(config.image_token_id) == tile_tokens * len(ours.pixel_values)
