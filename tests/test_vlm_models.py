"""Our VLMs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA) over a paged KV cache against HF
transformers.

Each tiny checkpoint is loaded twice: by ``load_model`` and by HF. Prompts come from the HF
processor (chat template, images -> pixel values, expanded placeholders); our side embeds the
images with ``embed_images``, writes them into the token embeddings at the image-token
positions and runs the paged forward with M-RoPE positions from ``get_mrope_input_positions``
(1-D for LLaVA), whole or in two chunks that cut an image in half, then one decode step.
The KV cache starts as NaN, so a read of an unwritten slot shows up in the logits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve.config import EngineArgs
from mm_serve.encoders.base import ProcessedImage
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.models.interface import VisionLanguageModel
from mm_serve.models.layers.rotary import MRotaryEmbedding
from mm_serve.models.loader import load_model
from mm_serve.models.mrope import get_mrope_input_positions
from tests.fixtures.vlm_checkpoints import FAMILIES, build_tiny_vlm_checkpoint

BLOCK_SIZE, NUM_BLOCKS = 4, 64
ATOL = 1e-4


def _image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic RGB image: smooth gradients plus noise (not flat, not pure noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


class Setup:
    """One tiny checkpoint: our model (``load_model``), the HF model and the HF processor."""

    def __init__(self, path: str, family: str) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.family = family
        self.config = EngineArgs(model=path, device="cpu").create_engine_config().model
        self.model = load_model(self.config, "cpu")
        self.hf = AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.processor = AutoProcessor.from_pretrained(path)

    def inputs(self, text: str, images: list[Image.Image]) -> dict[str, Any]:
        """HF processor outputs for one user turn: ``text`` after the images."""
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content}]
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        return self.processor(text=[prompt], images=images or None, return_tensors="pt")

    def processed_images(self, inputs: dict[str, Any]) -> list[ProcessedImage]:
        """HF's ``pixel_values`` split per image, as our preprocessing would hand them over."""
        if "pixel_values" not in inputs:
            return []
        if "image_grid_thw" not in inputs:  # LLaVA: [N, 3, H, W]
            ids = inputs["input_ids"][0]
            per_image = int((ids == self.model.image_token_id).sum()) // len(inputs["pixel_values"])
            return [ProcessedImage(pv, per_image) for pv in inputs["pixel_values"]]
        grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
        rows = inputs["pixel_values"].split([t * h * w for t, h, w in grids])
        merge = self.config.hf_config.vision_config.spatial_merge_size
        return [
            ProcessedImage(pv, t * h * w // merge**2, (t, h, w))
            for pv, (t, h, w) in zip(rows, grids, strict=True)
        ]

    @torch.inference_mode()
    def hf_logits(self, inputs: dict[str, Any]) -> torch.Tensor:
        return self.hf(**inputs).logits[0].float()


@pytest.fixture(scope="module", params=FAMILIES + ("qwen3_vl",))
def setup(request, tmp_path_factory) -> Setup:
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return Setup(path, request.param)


@dataclass
class Prompt:
    """A prompt ready for our model: token ids, merged embeddings and positions."""

    input_ids: torch.Tensor  # [T]
    inputs_embeds: torch.Tensor  # [T, hidden]
    positions: torch.Tensor  # [3, T] (mrope) or [T]
    mrope_delta: int


@torch.inference_mode()
def _prepare(setup: Setup, inputs: dict[str, Any]) -> Prompt:
    model = setup.model
    input_ids = inputs["input_ids"][0]
    images = setup.processed_images(inputs)
    embeds = model.get_input_embeddings(input_ids).clone()
    image_embeds = model.embed_images(images)
    assert [e.shape for e in image_embeds] == [(i.num_tokens, embeds.shape[1]) for i in images]
    is_image = input_ids == model.image_token_id
    assert int(is_image.sum()) == sum(i.num_tokens for i in images)
    if images:
        embeds[is_image] = torch.cat(image_embeds)
    if not model.uses_mrope:
        return Prompt(input_ids, embeds, torch.arange(len(input_ids)), 0)
    grids = [i.image_grid_thw for i in images]
    positions, delta = get_mrope_input_positions(input_ids.tolist(), grids, setup.config.hf_config)
    return Prompt(input_ids, embeds, positions, delta)


class PagedCache:
    """A NaN-filled paged KV cache for one request, blocks allocated in shuffled order."""

    def __init__(self, setup: Setup) -> None:
        cfg = setup.config
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        setup.model.bind_kv_cache([torch.full(shape, float("nan")) for _ in range(cfg.num_layers)])
        self.free = list(range(NUM_BLOCKS))
        random.Random(0).shuffle(self.free)
        self.table: list[int] = []

    def metadata(self, start: int, end: int) -> AttentionMetadata:
        """Metadata for computing tokens ``[start, end)`` after ``start`` cached ones."""
        while len(self.table) * BLOCK_SIZE < end:
            self.table.append(self.free.pop())
        slots = [
            self.table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
        ]
        return AttentionMetadata(
            num_reqs=1,
            num_tokens=end - start,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_table=torch.tensor([self.table], dtype=torch.int32),
            max_query_len=end - start,
            max_seq_len=end,
            query_start_loc_cpu=[0, end - start],
            seq_lens_cpu=[end],
        )


@torch.inference_mode()
def _run_chunks(setup: Setup, prompt: Prompt, cache: PagedCache, bounds: list[int]) -> torch.Tensor:
    """Prefill the prompt in chunks ``[bounds[i], bounds[i+1])``; logits of every token."""
    logits = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        hidden = setup.model(
            None,
            prompt.positions[..., start:end],
            cache.metadata(start, end),
            inputs_embeds=prompt.inputs_embeds[start:end],
        )
        logits.append(setup.model.compute_logits(hidden))
    return torch.cat(logits)


def _append_token(inputs: dict[str, Any], token_id: int) -> dict[str, Any]:
    """HF inputs for the prompt plus one generated (text) token."""
    longer = dict(inputs)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in inputs:
            value = token_id if key == "input_ids" else int(key == "attention_mask")
            extra = torch.full((1, 1), value, dtype=inputs[key].dtype)
            longer[key] = torch.cat([inputs[key], extra], dim=1)
    return longer


@torch.inference_mode()
def _check_decode(setup: Setup, inputs: dict[str, Any], prompt: Prompt, steps: int = 3) -> None:
    """Greedy decode steps after a full prefill: the token at sequence index ``i`` has position
    ``i + mrope_delta`` (1-D), and its logits are HF's over the whole sequence so far."""
    length = len(prompt.input_ids)
    cache = PagedCache(setup)
    logits = _run_chunks(setup, prompt, cache, [0, length])[-1:]
    for i in range(length, length + steps):
        token_id = int(logits[-1].argmax())
        inputs = _append_token(inputs, token_id)
        position = torch.tensor([i + prompt.mrope_delta])
        hidden = setup.model(torch.tensor([token_id]), position, cache.metadata(i, i + 1))
        logits = setup.model.compute_logits(hidden)
        torch.testing.assert_close(logits, setup.hf_logits(inputs)[-1:], atol=ATOL, rtol=0)


def _check_prompt(setup: Setup, text: str, images: list[Image.Image]) -> None:
    """Whole prefill, chunked prefill (cut in the middle of the first image) and decode steps
    all give HF's logits."""
    inputs = setup.inputs(text, images)
    expected = setup.hf_logits(inputs)
    prompt = _prepare(setup, inputs)
    length = len(prompt.input_ids)
    cut = length // 2
    if images:
        first_image_at = int((prompt.input_ids == setup.model.image_token_id).nonzero()[0])
        cut = first_image_at + setup.processed_images(inputs)[0].num_tokens // 2
        assert (prompt.input_ids[cut - 1 : cut + 1] == setup.model.image_token_id).all()
    for bounds in ([0, length], [0, cut, length]):
        logits = _run_chunks(setup, prompt, PagedCache(setup), bounds)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    _check_decode(setup, inputs, prompt)


def test_one_image(setup: Setup) -> None:
    _check_prompt(setup, "What is in this picture?", [_image(150, 110, seed=1)])


def test_two_images_of_different_sizes(setup: Setup) -> None:
    images = [_image(200, 130, seed=2), _image(70, 120, seed=3)]
    _check_prompt(setup, "Compare the two images.", images)


def test_text_only(setup: Setup) -> None:
    _check_prompt(setup, "Tell me about mountains and the sea.", [])


def test_interface(setup: Setup) -> None:
    model = setup.model
    assert isinstance(model, VisionLanguageModel)
    assert model.uses_mrope == (setup.family != "llava")
    assert model.image_token_id == setup.config.hf_config.image_token_id
    assert model.embed_images([]) == []
    assert len(model.attention_layers()) == setup.config.num_layers
    inputs = setup.inputs("Describe it.", [_image(64, 64, seed=4)])
    out = setup.hf.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 2)  # HF generate runs on the folder
    if setup.family != "llava":  # tied, as Qwen2-VL-2B: one tensor for both
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert isinstance(model.model.rotary_emb, MRotaryEmbedding)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_positions_match_hf_get_rope_index(family: str, tmp_path) -> None:
    from transformers import AutoModelForImageTextToText

    path = build_tiny_vlm_checkpoint(tmp_path, family)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    config = hf.config
    img, start, end = (
        config.image_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    )
    grids = [(1, 4, 6), (1, 8, 2), (2, 4, 4), (1, 2, 2)]
    rng = random.Random(0)
    ids: list[int] = []
    for t, h, w in grids:
        ids += [rng.randrange(300) for _ in range(rng.randrange(0, 5))]
        ids += [start] + [img] * (t * h * w // 4) + [end]
    ids += [rng.randrange(300) for _ in range(3)]
    ours, delta = get_mrope_input_positions(ids, grids, config)
    expected, hf_delta = hf.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([[int(i == img) for i in ids]]),
        image_grid_thw=torch.tensor(grids),
    )
    assert torch.equal(ours, expected[:, 0])
    assert delta == int(hf_delta) < 0
    text, text_delta = get_mrope_input_positions(list(range(8)), [], config)
    assert torch.equal(text, torch.arange(8).expand(3, 8)) and text_delta == 0
    with pytest.raises(ValueError, match="image"):
        get_mrope_input_positions(ids, grids + [(1, 2, 2)], config)
    # Once every image is placed, an image token (sampled, in a beam's continuation) is text.
    stray, _ = get_mrope_input_positions(ids + [img, 7], grids, config)
    assert torch.equal(stray[:, : len(ids)], ours)
    assert torch.equal(stray[:, len(ids) :], ours[:, -1:] + torch.tensor([[1, 2]]))


def test_mrotary_embedding_matches_hf() -> None:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    section = [4, 6, 6]
    hf_config = Qwen2VLTextConfig(
        hidden_size=128,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
    )
    rope = MRotaryEmbedding(32, 256, 1e6, section)
    positions = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(0))
    q, k = torch.randn(10, 4 * 32), torch.randn(10, 2 * 32)
    ours_q, ours_k = rope(positions, q, k)
    cos, sin = Qwen2VLRotaryEmbedding(hf_config)(q, positions[:, None])  # [1, 10, 32]
    hf_q, hf_k = apply_rotary_pos_emb(
        q.view(1, 10, 4, 32), k.view(1, 10, 2, 32), cos, sin, unsqueeze_dim=2
    )
    torch.testing.assert_close(ours_q, hf_q.reshape(10, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_k, hf_k.reshape(10, -1), atol=1e-5, rtol=0)
    # 1-D positions: plain RoPE, the same as three equal rows.
    flat = rope(positions[0], q, k)
    same = rope(positions[0].expand(3, -1), q, k)
    torch.testing.assert_close(flat, same, atol=1e-6, rtol=0)


@torch.inference_mode()
def test_loads_transformers5_in_memory_names(setup: Setup) -> None:
    """The HF model's own state dict (``model.visual.*`` / ``model.vision_tower.*``,
    ``model.language_model.*``, ``lm_head.*``) loads into the same parameters as the
    checkpoint's saved names."""
    names = list(setup.hf.state_dict())
    assert any(n.startswith("model.language_model.") for n in names)
    model = type(setup.model)(setup.config.hf_config)
    loaded = model.load_weights(setup.hf.state_dict().items())
    params = dict(model.named_parameters())
    assert loaded == set(params)
    for name, param in setup.model.named_parameters():
        assert torch.equal(params[name], param), name


@torch.inference_mode()
def test_bfloat16_load(setup: Setup) -> None:
    config = EngineArgs(model=setup.config.path, dtype="bfloat16", device="cpu")
    model = load_model(config.create_engine_config().model, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    inputs = setup.inputs("What is this?", [_image(90, 60, seed=5)])
    [image_embeds] = model.embed_images(setup.processed_images(inputs))
    assert image_embeds.dtype == torch.bfloat16
    input_ids = inputs["input_ids"][0]
    embeds = model.get_input_embeddings(input_ids).clone()
    embeds[input_ids == model.image_token_id] = image_embeds
    positions = torch.arange(len(input_ids))
    if model.uses_mrope:
        grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
        positions, _ = get_mrope_input_positions(input_ids.tolist(), grids, model.config)
    logits = model.compute_logits(model(None, positions, None, inputs_embeds=embeds))
    assert logits.dtype == torch.bfloat16 and logits.isfinite().all()
