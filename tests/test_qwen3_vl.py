"""Qwen3-VL (dense) against HF transformers on a tiny checkpoint (Qwen3 LM, DeepStack tower).

The processor: our pixels equal ``Qwen3VLProcessor``'s for a photograph, odd-sized and
grayscale images. The pieces: interleaved M-RoPE and the vision tower (merger and DeepStack
features, also for a two-frame grid) equal HF's modules. The engine: greedy tokens (and the
top log-probs) equal HF's ``generate`` for a batch mixing a text-only prompt, a photograph,
several odd-sized images in one prompt and a grayscale image, whole and with a token budget
smaller than every image (each image's rows, DeepStack columns included, split across
chunks); a repeated image is encoded once and hits the prefix cache. The published
architectures (Qwen3-VL-2B and -8B) load in HF and in our engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve.encoders.processors import get_image_processor
from mm_serve.models.qwen2_vl import pixels_on_device
from tests.fixtures import family_checks as checks
from tests.fixtures.images import Case, generated, mixed_batch, photo

TAG = "<|vision_start|><|image_pad|><|vision_end|>"
SMALL_BUDGET = 5  # tokens per step: below every test image's 6 or more image tokens


def cases() -> list[Case]:
    return mixed_batch(
        describe=f"{TAG}Describe the image.",
        compare=f"Compare {TAG} with {TAG} and {TAG} please.",
        several=[generated(301, 87, 1), generated(23, 45, 2), photo("astronaut.png")],
        what=f"{TAG}What is here?",
    )


path, reference = checks.checkpoint_fixtures("qwen3_vl", seed=3, nested_images=False)


@pytest.mark.parametrize(
    "image",
    [
        photo("grace_hopper.jpg"),
        photo("coffee.png"),
        generated(301, 87, 1),
        generated(23, 45, 2),
        photo("chelsea.png").convert("L"),
    ],
    ids=["photograph", "photograph_png", "odd_size", "tiny_odd_size", "grayscale"],
)
def test_processor_matches_hf(path, reference, image):
    """Final float32 patches equal HF's bit for bit, and so do the uint8 pixels the pool
    sends, once patchified and normalised as the model does on the device."""
    hf = reference.processor(text=[f"{TAG}Describe."], images=[image], return_tensors="pt")
    processor = checks.image_processor(path)
    ours = processor.preprocess(image)
    assert torch.equal(ours.pixel_values, hf["pixel_values"])
    assert ours.image_grid_thw == tuple(hf["image_grid_thw"][0].tolist())
    assert ours.num_tokens == int((hf["input_ids"] == checks.hf_config(path).image_token_id).sum())
    deferred = processor.preprocess(image, defer_normalization=True)
    assert deferred.pixel_values.dtype == torch.uint8
    vision = checks.hf_config(path).vision_config
    on_device = pixels_on_device([deferred], torch.device("cpu"), vision)
    assert torch.equal(on_device, hf["pixel_values"])


def test_interleaved_mrope_matches_hf():
    """Our rotary with Qwen3-VL's layout equals HF's ``Qwen3VLTextRotaryEmbedding``, and
    differs from the chunked layout of the same sections."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from mm_serve.models.layers.rotary import MRotaryEmbedding

    section, head_dim = [24, 20, 20], 128
    params = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": section}
    config = Qwen3VLTextConfig(
        hidden_size=512, num_attention_heads=4, head_dim=head_dim, rope_parameters=params
    )
    positions = torch.randint(0, 500, (3, 10), generator=torch.Generator().manual_seed(0))
    q, k = torch.randn(10, 4 * head_dim), torch.randn(10, 2 * head_dim)
    cos, sin = Qwen3VLTextRotaryEmbedding(config)(q, positions[:, None])
    hf_q, hf_k = apply_rotary_pos_emb(
        q.view(1, 10, 4, head_dim), k.view(1, 10, 2, head_dim), cos, sin, unsqueeze_dim=2
    )
    rope = MRotaryEmbedding(head_dim, 1024, 5e6, section, interleaved=True)
    ours_q, ours_k = rope(positions, q, k)
    torch.testing.assert_close(ours_q, hf_q.reshape(10, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_k, hf_k.reshape(10, -1), atol=1e-5, rtol=0)
    chunked_q, _ = MRotaryEmbedding(head_dim, 1024, 5e6, section)(positions, q, k)
    assert (chunked_q - ours_q).abs().max() > 0.1


@torch.inference_mode()
def test_tower_matches_hf(path, reference):
    """The merged tokens and each DeepStack feature equal HF's tower's, for images whose grids
    are smaller and larger than the position grid, and a two-frame grid (frames attend to
    themselves, the position embedding repeats)."""
    from mm_serve.encoders.qwen3_vl import Qwen3VisionTransformer

    hf_tower = reference.model.model.visual
    tower = Qwen3VisionTransformer(checks.hf_config(path).vision_config).eval()
    tower.load_state_dict(hf_tower.state_dict())
    grids = torch.tensor([[1, 4, 4], [1, 16, 10], [2, 6, 8]])
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 16 * 16)
    ours = tower(pixels, grids)
    hf = hf_tower(pixels, grid_thw=grids)
    out = hf.pooler_output.shape[-1]
    expected = torch.cat([hf.pooler_output, *hf.deepstack_features], dim=-1)
    assert ours.shape == (int(grids.prod(-1).sum()) // 4, 3 * out)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_every_image_is_larger_than_the_small_budget(path):
    """The premise of the "chunked" run: no test image fits one step of ``SMALL_BUDGET``."""
    processor = checks.image_processor(path)
    counts = [processor.preprocess(i).num_tokens for _, images in cases() for i in images]
    assert min(counts) > SMALL_BUDGET


@checks.whole_and_chunked(budget=SMALL_BUDGET)
def test_greedy_matches_hf(path, reference, engine_args):
    with checks.running_llm(path, **engine_args) as llm:
        checks.assert_matches_hf(llm, reference, cases())


def test_repeated_image_is_encoded_once_and_hits_the_prefix_cache(path, reference):
    """Two prompts of one batch with the same photograph: the tower encodes it once (encoder
    cache). Then the same prompt again: the prefix cache covers it. The same image before
    other text: the hit ends inside the image (block size 4), so the step after it takes the
    image's last rows, DeepStack columns included, from the encoder output. A different image
    behind the same text hits nothing. All match HF."""
    args = dict(
        enable_prefix_caching=True, block_size=4, max_num_batched_tokens=16, multiprocess=False
    )
    with checks.running_llm(path, **args) as llm:
        model = llm.engine_core.model_runner.model
        encoded = checks.record_encoded_images(llm)
        image = photo("grace_hopper.jpg")
        case = (f"{TAG}Describe the image.", [image])
        other = (f"Another look: {TAG} What is it?", [image])
        first, _ = checks.assert_matches_hf(llm, reference, [case, other])
        assert len(encoded) == 1
        (second,) = checks.assert_matches_hf(llm, reference, [case])
        assert second.num_cached_tokens >= len(second.prompt_token_ids) - 4
        (branch,) = checks.assert_matches_hf(llm, reference, [(f"{TAG}Something else?", [image])])
        image_end = 1 + branch.prompt_token_ids.count(model.image_token_id)  # after the start
        assert image_end - 4 < branch.num_cached_tokens < image_end
        (third,) = checks.assert_matches_hf(llm, reference, [(case[0], [photo("coffee.png")])])
        assert third.num_cached_tokens < 4
        assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_chat_with_image_part(path, reference):
    """A chat turn with an image part: the chat template's placeholder expanded as HF's
    processor does, and HF's greedy tokens."""
    with checks.running_llm(path) as llm:
        checks.assert_image_chat_matches_hf(llm, reference, [photo("rocket.jpg")])


# Published values: text (hidden, intermediate, layers, heads, KV heads, tied), vision (depth,
# width, output width, DeepStack blocks).
PUBLISHED = {
    "qwen3-vl-2b": ((2048, 6144, 28, 16, 8, True), (24, 1024, 2048, [5, 11, 17])),
    "qwen3-vl-8b": ((4096, 12288, 36, 32, 8, False), (27, 1152, 4096, [8, 16, 24])),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_architecture_has_the_published_config(tmp_path, name):
    """The weightless folder of the benchmarks: HF and our engine read the published sizes,
    and both resize a 1280 x 720 image into 40 x 22 tokens of 32 x 32 pixels."""
    from transformers import AutoProcessor

    from mm_serve.config import EngineArgs
    from tests.fixtures.checkpoints import write_architecture

    text, vision = PUBLISHED[name]
    folder = write_architecture(name, tmp_path)
    config = checks.hf_config(folder)
    t, v = config.text_config, config.vision_config
    heads = (t.num_attention_heads, t.num_key_value_heads, config.tie_word_embeddings)
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, *heads) == text
    assert (v.depth, v.hidden_size, v.out_hidden_size, v.deepstack_visual_indexes) == vision
    assert t.rope_parameters["mrope_section"] == [24, 20, 20]
    assert t.rope_parameters["mrope_interleaved"] and t.head_dim == 128
    engine = EngineArgs(model=folder, device="cpu", load_format="dummy").create_engine_config()
    assert (engine.model.num_layers, engine.model.head_dim) == (text[2], 128)
    image = Image.fromarray(np.zeros((720, 1280, 3), dtype=np.uint8))
    grid = AutoProcessor.from_pretrained(folder).image_processor(images=[image])["image_grid_thw"]
    ours = get_image_processor(folder, config).preprocess(image)
    assert int(grid.prod()) // 4 == ours.num_tokens == 40 * 22
