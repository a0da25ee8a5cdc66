"""LLaVA-OneVision against HF transformers on a tiny checkpoint (Qwen2 LM, SigLIP anyres tiles).

The processor: our pixels and token counts equal ``LlavaOnevisionProcessor``'s for a
photograph, odd sizes that pick different grids, extreme aspect ratios and a grayscale image,
alone in a prompt (anyres tiles) and among several (one padded tile each); the token counts
also for the published settings (384-pixel tiles, 36 pinpoints, ``anyres_max_9``). The engine:
greedy tokens (and the top log-probs) equal HF's ``generate`` for a batch mixing a text-only
prompt, a photograph, several odd-sized images in one prompt (among them the photograph again)
and a grayscale image, whole and in 8-token chunks that cut every image, with prefix caching
hitting a repeated image, the encoder cache serving it to a second prompt, and nothing left
held after.
"""

from __future__ import annotations

import random

import pytest
import torch

from mm_serve import SamplingParams
from mm_serve.checkpoint.dummy_processors import onevision_tokenizer
from mm_serve.encoders.anyres import anyres_layout, select_best_resolution
from mm_serve.encoders.llava_onevision_processor import LlavaOnevisionImageProcessor
from mm_serve.encoders.processors import get_image_processor
from tests.fixtures import family_checks as checks
from tests.fixtures.images import Case, generated, mixed_batch, photo
from tests.fixtures.llava_onevision_checkpoint import ONEVISION_PINPOINTS

PROMPT = "<|im_start|>user\n<image>\nDescribe the image.<|im_end|>\n<|im_start|>assistant\n"
# Sizes (width, height) whose best resolutions differ: 1x1, 1x2, 2x1, 2x2, 1x3 and 3x1 tiles.
ODD_SIZES = [
    (23, 45),
    (301, 87),
    (40, 150),
    (64, 64),
    (1000, 20),
    (17, 90),
    (20, 30),
    (50, 30),
    (70, 40),
]


def cases() -> list[Case]:
    return mixed_batch(
        describe=PROMPT,
        compare="Compare <image> with <image> and <image> please.",
        several=[generated(301, 87, 1), photo("grace_hopper.jpg"), generated(23, 45, 2)],
        what="<image>What is here?",
    )


path, reference = checks.checkpoint_fixtures("llava_onevision", seed=3)


def image_tokens(processor, inputs) -> int:
    return int((inputs["input_ids"][0] == processor.image_token_id).sum())


@pytest.mark.parametrize(
    "image",
    [photo("grace_hopper.jpg"), photo("chelsea.png").convert("L")]
    + [generated(w, h, i) for i, (w, h) in enumerate(ODD_SIZES)],
    ids=["photograph", "grayscale"] + [f"{w}x{h}" for w, h in ODD_SIZES],
)
def test_processor_matches_hf(path, reference, image):
    processor = reference.processor
    hf = processor(text=["<image>Describe."], images=[[image]], return_tensors="pt")
    ours = checks.image_processor(path).preprocess(image)
    assert torch.equal(ours.pixel_values, hf["pixel_values"][0])  # one image: no padding tiles
    assert ours.num_tokens == image_tokens(processor, hf)
    assert ours.image_size == tuple(hf["image_sizes"][0].tolist())
    deferred = checks.image_processor(path).preprocess(image, True)
    assert deferred.pixel_values.dtype == torch.uint8 and deferred.pixel_mean


def test_odd_sizes_pick_different_grids(path):
    """Every pinpoint is chosen by some odd size; some maps are downsampled, some not."""
    processor = checks.image_processor(path)
    layouts = [anyres_layout(h, w, ONEVISION_PINPOINTS, 32, 4, 2) for w, h in ODD_SIZES]
    assert {layout.grid for layout in layouts} == {(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (3, 1)}
    assert {layout.final == layout.unpadded for layout in layouts} == {True, False}
    tiles = {processor.preprocess(generated(w, h, 0)).pixel_values.shape[0] for w, h in ODD_SIZES}
    assert tiles == {2, 3, 4, 5}


def test_several_images_match_hf(path, reference):
    """In a prompt of several images each is one tile padded to a square with the mean colour,
    and takes ``side**2 + 1`` tokens."""
    processor = reference.processor
    images = [generated(301, 87, 1), photo("grace_hopper.jpg"), generated(23, 45, 2)]
    hf = processor(text=["<image><image><image>"], images=[images], return_tensors="pt")
    ours = checks.image_processor(path).for_prompt(len(images))
    items = [ours.preprocess(image) for image in images]
    for i, item in enumerate(items):
        assert torch.equal(item.pixel_values, hf["pixel_values"][i][:1])
    assert sum(item.num_tokens for item in items) == image_tokens(processor, hf)
    assert ours.max_num_tokens == items[0].num_tokens == 17
    assert ours.hash_kwargs() != ours.for_prompt(1).hash_kwargs()


def test_token_counts_match_hf_for_published_settings():
    """The published processor (384-pixel tiles of 27 x 27 features, 36 pinpoints up to 6 x 6
    tiles, ``anyres_max_9``): our count equals HF's for random and extreme sizes, and
    ``max_num_tokens`` bounds them all."""
    from mm_serve.utils._compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import LlavaOnevisionImageProcessor as HFImageProcessor
    from transformers import LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor
    from transformers.image_processing_utils import select_best_resolution as hf_best

    hf_image_processor = HFImageProcessor()
    hf = LlavaOnevisionProcessor(
        image_processor=hf_image_processor,
        tokenizer=onevision_tokenizer(),
        video_processor=LlavaOnevisionVideoProcessor(),
        num_image_tokens=729,
        vision_feature_select_strategy="full",
    )
    config = {**hf_image_processor.to_dict(), "size": {"height": 384, "width": 384}}
    ours = LlavaOnevisionImageProcessor.from_config(config, tile=384, side=27, max_tiles=9)
    rng = random.Random(0)
    sizes = [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(300)]
    sizes += [(1, 1), (1, 4000), (4000, 1), (384, 384), (2304, 2304), (2304, 768), (899, 1024)]
    sizes += [(rng.randint(1, 60), rng.randint(1000, 9000)) for _ in range(30)]
    expected = hf._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    counts = [ours.num_tokens(h, w) for h, w in sizes]
    assert counts == expected
    pinpoints = hf_image_processor.image_grid_pinpoints
    assert all(
        select_best_resolution(h, w, pinpoints) == hf_best((h, w), pinpoints) for h, w in sizes
    )
    assert max(counts) <= ours.max_num_tokens < 1.1 * max(counts)


def test_max_num_tokens_bounds_every_image(path):
    processor = checks.image_processor(path)
    rng = random.Random(1)
    sizes = [(rng.randint(1, 400), rng.randint(1, 400)) for _ in range(300)]
    counts = [processor.num_tokens(h, w) for h, w in sizes]
    assert max(counts) <= processor.max_num_tokens < 1.1 * max(counts)


@checks.whole_and_chunked(budget=8)
def test_greedy_matches_hf(path, reference, engine_args):
    with checks.running_llm(path, **engine_args) as llm:
        checks.assert_matches_hf(llm, reference, cases())


def test_extreme_aspect_ratio_matches_hf(path, reference):
    """A 1000 x 20 image: its unpadded feature map has no row left (base tile only)."""
    image = generated(1000, 20, 5)
    assert checks.image_processor(path).preprocess(image).num_tokens == 16
    with checks.running_llm(path) as llm:
        checks.assert_matches_hf(llm, reference, [(PROMPT, [image])])


def test_prefix_cache_hits_repeated_image(path, reference):
    """The same photograph twice, one request after the other: the second reuses the first's
    KV blocks (prefix cache, image hash in the block hashes) and still matches HF; a different
    image behind the same text does not hit past the text."""
    args = dict(enable_prefix_caching=True, block_size=4, max_num_batched_tokens=16)
    with checks.running_llm(path, **args) as llm:
        case = (PROMPT, [photo("grace_hopper.jpg")])
        checks.assert_prefix_cache_hits(llm, reference, case, case, (PROMPT, [photo("coffee.png")]))


def test_encoder_cache_hits_repeated_image(path, reference):
    """Without prefix caching, the same photograph behind two texts is encoded once: the
    second request takes its embeddings from the encoder cache, and both match HF."""
    with checks.running_llm(path, enable_prefix_caching=False, multiprocess=False) as llm:
        encoded = checks.record_encoded_images(llm)
        image = photo("grace_hopper.jpg")
        cases = [(PROMPT, [image]), ("<image>Other text.", [image])]
        first, second = checks.assert_matches_hf(llm, reference, cases)
        assert len(encoded) == 1
        assert (first.num_cached_images, second.num_cached_images) == (0, 1)


def test_chat_with_image_parts(path, reference):
    """A chat turn with one image part, and one with two: the chat template's ``<image>``s
    expanded as HF's processor does (anyres tiles, then one tile each), HF's greedy tokens."""
    with checks.running_llm(path) as llm:
        for images in ([photo("rocket.jpg")], [photo("rocket.jpg"), generated(40, 150, 3)]):
            checks.assert_image_chat_matches_hf(llm, reference, images)


def _hub_name(name: str) -> str:
    """llava-hf's names: the tower under ``vision_model.``."""
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1)


def _in_memory_name(name: str) -> str:
    """transformers 5's module names: everything but the LM head under ``model.``."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


@pytest.mark.parametrize("rename", [_hub_name, _in_memory_name], ids=["hub", "in_memory"])
def test_checkpoint_names_load_the_same_weights(path, tmp_path, rename):
    import shutil

    from safetensors.torch import load_file, save_file

    from mm_serve.config import EngineArgs
    from mm_serve.models.loader import load_model

    folder = tmp_path / "renamed"
    shutil.copytree(path, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({rename(k): v for k, v in tensors.items()}, str(folder / "model.safetensors"))

    def weights(model_path) -> dict[str, torch.Tensor]:
        config = EngineArgs(model=str(model_path), device="cpu").create_engine_config()
        return dict(load_model(config.model, "cpu").named_parameters())

    expected, renamed = weights(path), weights(folder)
    assert expected.keys() == renamed.keys()
    assert all(torch.equal(expected[k], renamed[k]) for k in expected)


def test_image_size_crosses_the_wire(path):
    """An image's original size travels to the engine core with its pixels."""
    from mm_serve.messages.request import MultiModalFeature, PlaceholderRange, Request
    from mm_serve.messages.wire import InputCodec

    item = checks.image_processor(path).preprocess(generated(100, 60, 0), True)
    prompt = [1, 2, *[checks.hf_config(path).image_token_id] * item.num_tokens, 3]
    feature = MultiModalFeature("h", PlaceholderRange(2, item.num_tokens), item)
    request = Request("r", prompt, SamplingParams(), mm_features=[feature])
    codec = InputCodec()
    (decoded,) = codec.decode(codec.encode_request(request))
    data = decoded.mm_features[0].data
    assert data.image_size == item.image_size == (60, 100)
    assert torch.equal(data.pixel_values, item.pixel_values)
    assert data.pixel_mean == item.pixel_mean


@pytest.mark.parametrize(
    "name, text, tied",
    [
        ("llava-onevision-qwen2-0.5b-ov", (896, 4864, 24, 14, 2, 152000), True),
        ("llava-onevision-qwen2-7b-ov", (3584, 18944, 28, 28, 4, 152128), False),
    ],
)
def test_benchmark_architecture_has_the_published_config(tmp_path, name, text, tied):
    """The weightless benchmark folder: the published sizes, read by HF and by our engine
    config, and HF's processor and ours agree on the pixels and tokens of a 1280 x 720 photo."""
    from transformers import AutoProcessor

    from mm_serve.config import EngineArgs
    from tests.fixtures.checkpoints import write_architecture

    folder = write_architecture(name, tmp_path)
    config = checks.hf_config(folder)
    t, v = config.text_config, config.vision_config
    heads = (t.num_attention_heads, t.num_key_value_heads, t.vocab_size)
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, *heads) == text
    assert (v.hidden_size, v.num_hidden_layers, v.image_size, v.patch_size) == (1152, 26, 384, 14)
    assert config.tie_word_embeddings is tied and len(config.image_grid_pinpoints) == 36
    image = photo("grace_hopper.jpg").resize((1280, 720))
    hf = AutoProcessor.from_pretrained(folder)
    inputs = hf(text=["<image>"], images=[[image]], return_tensors="pt")
    ours = get_image_processor(folder, config).preprocess(image)
    assert torch.equal(ours.pixel_values, inputs["pixel_values"][0])
    assert ours.num_tokens == image_tokens(hf, inputs)
    engine = EngineArgs(model=folder, device="cpu", load_format="dummy").create_engine_config()
    assert engine.multimodal.max_image_tokens >= ours.num_tokens
