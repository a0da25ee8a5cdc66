"""Idefics3 / SmolVLM against HF transformers on a tiny checkpoint (Llama LM, SigLIP tiles).

The processor: our pixels and our placeholder expansion (tile tags, newlines, global image)
equal ``Idefics3Processor``'s for a photograph, odd-sized and grayscale images. The engine:
greedy tokens (and the top log-probs) equal HF's ``generate`` for a batch mixing a text-only
prompt, a photograph, two odd-sized images in one prompt and a grayscale image, whole, in
8-token chunks that cut the expansions anywhere, and with prefix caching hitting a repeated
image.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.encoders.processors import get_image_processor
from mm_serve.testing.hf_reference import hf_greedy_generate
from mm_serve.testing.leaks import assert_llm_idle
from mm_serve.testing.vlm_checkpoints import build_tiny_vlm_checkpoint

MAX_NEW_TOKENS = 12
LOGPROB_TOL = 1e-4


def photo(name: str) -> Image.Image:
    """A real photograph shipped inside an installed package."""
    if name == "grace_hopper.jpg":
        import matplotlib

        return Image.open(Path(matplotlib.get_data_path()) / "sample_data" / name)
    import skimage

    return Image.open(Path(skimage.__file__).parent / "data" / name)


def generated(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def cases() -> list[tuple[str, list[Image.Image]]]:
    return [
        ("A text-only question about nothing in particular.", []),
        ("User:<image>Describe the image.", [photo("grace_hopper.jpg")]),
        ("Compare <image> with <image> please.", [generated(301, 87, 1), generated(23, 45, 2)]),
        ("<image>What is here?", [photo("chelsea.png").convert("L")]),
    ]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("idefics3"), "idefics3", seed=3)


@pytest.fixture(scope="module")
def reference(path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return processor, model


def hf_greedy(reference, text: str, images: list[Image.Image]):
    """(prompt ids, greedy ids, per-step log-softmax ``[steps, vocab]``) of HF."""
    processor, model = reference
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    return hf_greedy_generate(model, inputs, MAX_NEW_TOKENS)


@pytest.mark.parametrize(
    "image",
    [photo("grace_hopper.jpg"), generated(301, 87, 1), photo("chelsea.png").convert("L")],
    ids=["photograph", "odd_size", "grayscale"],
)
def test_processor_matches_hf(path, reference, image):
    processor = reference[0]
    text = "User:<image>Describe."
    hf = processor(text=[text], images=[[image]], return_tensors="pt")
    ours = get_image_processor(path, processor_config(path)).preprocess(image)
    assert torch.equal(ours.pixel_values, hf["pixel_values"][0])  # no padding tiles: one image
    ids = processor.tokenizer(text)["input_ids"]
    at = ids.index(processor.image_token_id)
    assert ids[:at] + list(ours.token_ids) + ids[at + 1 :] == hf["input_ids"][0].tolist()
    assert ours.num_tokens == len(ours.token_ids)


def processor_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def test_max_num_tokens_bounds_every_image(path):
    processor = get_image_processor(path, processor_config(path))
    sizes = [(1, 1), (7, 1000), (1000, 7), (143, 144), (145, 145), (5000, 3000), (48, 49)]
    counts = [processor.preprocess(generated(w, h, 0)).num_tokens for w, h in sizes]
    assert max(counts) == processor.max_num_tokens


def assert_matches_hf(llm: LLM, reference, prompts: list[tuple[str, list[Image.Image]]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)
    inputs = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    for (text, images), output in zip(prompts, outputs, strict=True):
        prompt_ids, ref_tokens, ref_logprobs = hf_greedy(reference, text, images)
        assert output.prompt_token_ids == prompt_ids  # expansion as HF's processor
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        for step, step_logprobs in enumerate(completion.logprobs):
            for token_id, logprob in step_logprobs.items():
                assert abs(logprob.logprob - ref_logprobs[step, token_id].item()) < LOGPROB_TOL
    assert_llm_idle(llm)
    return outputs


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 8, "block_size": 4}],
    ids=["whole", "chunked"],
)
def test_greedy_matches_hf(path, reference, engine_args):
    llm = LLM(path, **engine_args)
    try:
        assert_matches_hf(llm, reference, cases())
    finally:
        llm.shutdown()


def test_prefix_cache_hits_repeated_image(path, reference):
    """The same photograph twice, one request after the other: the second reuses the first's
    KV blocks (prefix cache, image hash in the block hashes) and still matches HF; a different
    image behind the same text does not hit past the text."""
    llm = LLM(path, enable_prefix_caching=True, block_size=4, max_num_batched_tokens=16)
    try:
        image = photo("grace_hopper.jpg")
        case = ("User:<image>Describe the image.", [image])
        (first,) = assert_matches_hf(llm, reference, [case])
        (second,) = assert_matches_hf(llm, reference, [case])
        assert second.num_cached_tokens >= len(second.prompt_token_ids) - 4
        other = ("User:<image>Describe the image.", [photo("coffee.png")])
        (third,) = assert_matches_hf(llm, reference, [other])
        assert third.num_cached_tokens < 8
        assert first.outputs[0].token_ids == second.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_chat_with_image_part(path, reference):
    """A chat turn with an image part: the chat template's ``<image>`` expanded as HF's
    processor does, and HF's greedy tokens."""
    processor, model = reference
    image = photo("rocket.jpg")
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}],
        }
    ]
    llm = LLM(path)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
        (output,) = llm.chat(messages, params, use_tqdm=False)
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        prompt_ids, ref_tokens, _ = hf_greedy(reference, text, [image])
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == ref_tokens
        assert_llm_idle(llm)
    finally:
        llm.shutdown()


def test_token_ids_cross_the_wire(path):
    """An image's own prompt tokens travel to the engine core with its pixels."""
    from mm_serve.messages import InputCodec
    from mm_serve.request import MultiModalFeature, PlaceholderRange, Request

    item = get_image_processor(path, processor_config(path)).preprocess(generated(100, 60, 0))
    prompt = [1, 2, *item.token_ids, 3]
    feature = MultiModalFeature("h", PlaceholderRange(2, item.num_tokens), item)
    request = Request("r", prompt, SamplingParams(), mm_features=[feature])
    codec = InputCodec()
    (decoded,) = codec.decode(codec.encode_request(request))
    data = decoded.mm_features[0].data
    assert data.token_ids == item.token_ids and data.num_tokens == item.num_tokens
    assert torch.equal(data.pixel_values, item.pixel_values)
