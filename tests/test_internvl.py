"""InternVL3 against HF transformers on a tiny checkpoint (Qwen2 LM, InternViT tiles).

The processor: our pixels and our placeholder expansion (``<img>``, the tiles' image tokens,
``</img>``) equal ``InternVLProcessor``'s for photographs, odd-sized images of several tile
counts and a grayscale image. The tower: equal to HF's ``InternVLVisionModel`` with the
options InternVL3 leaves off (q/k norm, RMSNorm, the final LayerNorm, an inner feature
layer). The engine: greedy tokens and top-5 log-probs equal HF's ``generate`` for a batch
mixing a text-only prompt, a photograph, three odd-sized images in one prompt and a grayscale
image, whole and in 8-token chunks that cut every expansion, and with prefix caching hitting a
repeated image.
"""

from __future__ import annotations

import pytest
import torch

from mm_serve.encoders.processors import get_image_processor
from mm_serve.models.vlm import tiles_on_device
from tests.fixtures import family_checks as checks
from tests.fixtures.family_checkpoint import TINY_VISION
from tests.fixtures.images import Case, generated, mixed_batch, photo

IMAGE = "<IMG_CONTEXT>"


def cases() -> list[Case]:
    odd = [generated(301, 87, 1), generated(23, 45, 2), generated(40, 41, 3)]  # 13, 3, 1 tiles
    return mixed_batch(
        describe=f"User: {IMAGE}\nDescribe the image.",
        compare=f"Compare {IMAGE} with {IMAGE} and {IMAGE} please.",
        several=odd,
        what=f"{IMAGE}\nWhat is here?",
    )


path, reference = checks.checkpoint_fixtures("internvl", seed=3)


@pytest.mark.parametrize(
    ("image", "num_tiles"),
    [
        (photo("grace_hopper.jpg"), 13),
        (photo("coffee.png"), 7),
        (generated(301, 87, 1), 13),
        (generated(23, 45, 2), 3),
        (generated(40, 41, 3), 1),
        (generated(97, 33, 4), 4),
        (photo("chelsea.png").convert("L"), 7),
    ],
    ids=["photograph", "photograph2", "wide", "tall", "one_tile", "three_by_one", "grayscale"],
)
def test_processor_matches_hf(path, reference, image, num_tiles):
    processor = reference.processor
    text = f"User: {IMAGE}\nDescribe."
    hf = processor(text=[text], images=[[image]], return_tensors="pt")
    ours = checks.image_processor(path).preprocess(image)
    assert ours.pixel_values.shape[0] == num_tiles
    assert torch.equal(ours.pixel_values, hf["pixel_values"])
    checks.assert_expansion_matches_hf(processor, text, ours, hf["input_ids"])
    deferred = checks.image_processor(path).preprocess(image, defer_normalization=True)
    assert deferred.pixel_values.dtype == torch.uint8 and deferred.token_ids == ours.token_ids
    on_device = tiles_on_device([deferred], torch.device("cpu"))  # the engine's path
    assert torch.equal(on_device, hf["pixel_values"])


def test_max_num_tokens_bounds_every_image(path):
    processor = checks.image_processor(path)
    sizes = [(1, 1), (7, 1000), (1000, 7), (143, 144), (5000, 3000), (32, 33), (13, 1)]
    counts = [processor.preprocess(generated(w, h, 0)).num_tokens for w, h in sizes]
    assert max(counts) == processor.max_num_tokens == 2 + 13 * processor.image_seq_len


@pytest.mark.parametrize(
    "options",
    [
        dict(use_qk_norm=True, norm_type="rms_norm", use_mean_pooling=False),
        dict(use_qk_norm=False, norm_type="layer_norm", use_mean_pooling=False),
    ],
    ids=["qk_norm_rms_norm", "final_layernorm"],
)
@pytest.mark.parametrize("feature_layer", [-1, -2])
def test_tower_options_match_hf(options, feature_layer):
    """The tower options InternVL3 leaves off, against HF's ``InternVLVisionModel``."""
    from transformers import InternVLVisionConfig, InternVLVisionModel

    from mm_serve.encoders.internvl import InternVisionModel

    tower = {**TINY_VISION, "num_hidden_layers": 3}  # two for feature_layer -2, and a last
    config = InternVLVisionConfig(**tower, image_size=32, patch_size=8, **options)
    torch.manual_seed(0)
    hf = InternVLVisionModel(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    ours = InternVisionModel(config, feature_layer)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and not unexpected
    pixels = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        out = hf(pixels, output_hidden_states=True)
        expected = out.last_hidden_state if feature_layer == -1 else out.hidden_states[-2]
        torch.testing.assert_close(ours(pixels), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "billions"), [("internvl3-8b", 7.94), ("internvl3-2b", 2.09)], ids=["8b", "2b"]
)
def test_benchmark_architecture(tmp_path, name, billions):
    """The weightless InternVL3 folders: HF's model and ours have the same parameters (the
    published count), and our processor gives HF's pixels on the published 448-pixel tiles."""
    from transformers import AutoConfig, AutoProcessor
    from transformers import InternVLForConditionalGeneration as HFModel

    from mm_serve.models.internvl import InternVLForConditionalGeneration
    from tests.fixtures.checkpoints import write_architecture

    folder = write_architecture(name, tmp_path)
    config = AutoConfig.from_pretrained(folder)
    counts = checks.meta_parameter_counts(config, HFModel, InternVLForConditionalGeneration)
    assert counts[0] == counts[1] and round(counts[0] / 1e9, 2) == billions
    image = photo("chelsea.png")
    hf = AutoProcessor.from_pretrained(folder)(text=[IMAGE], images=[[image]], return_tensors="pt")
    ours = get_image_processor(folder, config).preprocess(image)
    assert torch.equal(ours.pixel_values, hf["pixel_values"])
    assert list(ours.token_ids) == hf["input_ids"][0].tolist()
    assert ours.num_tokens == 2 + 256 * len(ours.pixel_values)


@checks.whole_and_chunked(budget=8)
def test_greedy_matches_hf(path, reference, engine_args):
    with checks.running_llm(path, **engine_args) as llm:
        checks.assert_matches_hf(llm, reference, cases())


def test_tensor_parallel_matches_hf(path, reference):
    """Two ranks (the tower replicated, the Qwen2 LM sharded) give HF's tokens too."""
    args = dict(tensor_parallel_size=2, device="cpu", max_num_batched_tokens=32)
    with checks.running_llm(path, **args) as llm:
        checks.assert_matches_hf(llm, reference, cases())


def test_prefix_cache_hits_repeated_image(path, reference):
    """The same photograph (13 tiles) twice, one request after the other, opened twice: the
    second reuses the first's KV blocks (prefix cache, the image's content hash in the block
    hashes) and still matches HF; a different image behind the same text does not hit past
    the text."""
    args = dict(enable_prefix_caching=True, block_size=4, max_num_batched_tokens=16)
    with checks.running_llm(path, **args) as llm:
        text = f"User: {IMAGE}\nDescribe the image."
        case, again = (text, [photo("grace_hopper.jpg")]), (text, [photo("grace_hopper.jpg")])
        checks.assert_prefix_cache_hits(llm, reference, case, again, (text, [photo("coffee.png")]))


def test_repeated_image_hits_encoder_cache(path, reference):
    """Two requests with the same photograph, chunked side by side without prefix caching:
    its tiles go through the tower once (encoder cache), and both match HF."""
    args = dict(
        enable_prefix_caching=False, block_size=4, max_num_batched_tokens=16, multiprocess=False
    )
    with checks.running_llm(path, **args) as llm:
        encoded = checks.record_encoded_images(llm)
        image = photo("grace_hopper.jpg")
        prompts = [(f"User: {IMAGE}\nDescribe.", [image]), (f"{IMAGE}\nWhat is it?", [image])]
        checks.assert_matches_hf(llm, reference, prompts)
        assert [len(item.pixel_values) for item in encoded] == [13]


def test_chat_with_image_part(path, reference):
    """A chat turn with an image part: the chat template's image token expanded as HF's
    processor does, and HF's greedy tokens."""
    with checks.running_llm(path) as llm:
        checks.assert_image_chat_matches_hf(llm, reference, [photo("rocket.jpg")])
