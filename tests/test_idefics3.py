"""Idefics3 / SmolVLM against HF transformers on a tiny checkpoint (Llama LM, SigLIP tiles).

The processor: our pixels and our placeholder expansion (tile tags, newlines, global image)
equal ``Idefics3Processor``'s for a photograph, odd-sized and grayscale images. The engine:
greedy tokens (and the top log-probs) equal HF's ``generate`` for a batch mixing a text-only
prompt, a photograph, two odd-sized images in one prompt and a grayscale image, whole, in
8-token chunks that cut the expansions anywhere, and with prefix caching hitting a repeated
image.
"""

from __future__ import annotations

import pytest
import torch

from mm_serve import SamplingParams
from mm_serve.models.vlm import tiles_on_device
from tests.fixtures import family_checks as checks
from tests.fixtures.images import Case, generated, mixed_batch, photo, processor_images


def cases() -> list[Case]:
    return mixed_batch(
        describe="User:<image>Describe the image.",
        compare="Compare <image> with <image> please.",
        several=[generated(301, 87, 1), generated(23, 45, 2)],
        what="<image>What is here?",
    )


path, reference = checks.checkpoint_fixtures("idefics3", seed=3)


@pytest.mark.parametrize("image", processor_images().values(), ids=processor_images().keys())
def test_processor_matches_hf(path, reference, image):
    processor = reference.processor
    text = "User:<image>Describe."
    hf = processor(text=[text], images=[[image]], return_tensors="pt")
    ours = checks.image_processor(path).preprocess(image)
    assert torch.equal(ours.pixel_values, hf["pixel_values"][0])  # no padding tiles: one image
    checks.assert_expansion_matches_hf(processor, text, ours, hf["input_ids"])
    deferred = checks.image_processor(path).preprocess(image, defer_normalization=True)
    assert deferred.pixel_values.dtype == torch.uint8 and deferred.token_ids == ours.token_ids
    on_device = tiles_on_device([deferred], torch.device("cpu"))  # the engine's path
    assert torch.equal(on_device, hf["pixel_values"][0])


def test_max_num_tokens_bounds_every_image(path):
    processor = checks.image_processor(path)
    sizes = [(1, 1), (7, 1000), (1000, 7), (143, 144), (145, 145), (5000, 3000), (48, 49)]
    counts = [processor.preprocess(generated(w, h, 0)).num_tokens for w, h in sizes]
    assert max(counts) == processor.max_num_tokens


@checks.whole_and_chunked(budget=8)
def test_greedy_matches_hf(path, reference, engine_args):
    with checks.running_llm(path, **engine_args) as llm:
        checks.assert_matches_hf(llm, reference, cases())


def test_prefix_cache_hits_repeated_image(path, reference):
    """The same photograph twice, one request after the other: the second reuses the first's
    KV blocks (prefix cache, image hash in the block hashes) and still matches HF; a different
    image behind the same text does not hit past the text."""
    args = dict(enable_prefix_caching=True, block_size=4, max_num_batched_tokens=16)
    with checks.running_llm(path, **args) as llm:
        case = ("User:<image>Describe the image.", [photo("grace_hopper.jpg")])
        other = ("User:<image>Describe the image.", [photo("coffee.png")])
        checks.assert_prefix_cache_hits(llm, reference, case, case, other)


def test_chat_with_image_part(path, reference):
    """A chat turn with an image part: the chat template's ``<image>`` expanded as HF's
    processor does, and HF's greedy tokens."""
    with checks.running_llm(path) as llm:
        checks.assert_image_chat_matches_hf(llm, reference, [photo("rocket.jpg")])


def test_token_ids_cross_the_wire(path):
    """An image's own prompt tokens travel to the engine core with its pixels."""
    from mm_serve.messages.request import MultiModalFeature, PlaceholderRange, Request
    from mm_serve.messages.wire import InputCodec

    item = checks.image_processor(path).preprocess(generated(100, 60, 0))
    prompt = [1, 2, *item.token_ids, 3]
    feature = MultiModalFeature("h", PlaceholderRange(2, item.num_tokens), item)
    request = Request("r", prompt, SamplingParams(), mm_features=[feature])
    codec = InputCodec()
    (decoded,) = codec.decode(codec.encode_request(request))
    data = decoded.mm_features[0].data
    assert data.token_ids == item.token_ids and data.num_tokens == item.num_tokens
    assert torch.equal(data.pixel_values, item.pixel_values)
