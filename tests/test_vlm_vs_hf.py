"""VLMs through the engine against HF transformers on the same folder and the same images.

Batches mix text-only prompts, one image, three images of different sizes and an image in the
middle of the prompt; a small token budget splits images across chunks. Checkpoints are laid
out as the installed transformers saves them; the chat test also runs on the hub's older
layout (``preprocessor_config.json``, ``chat_template.json``).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve import LLM, SamplingParams
from tests.fixtures.hf_reference import hf_greedy_generate
from tests.fixtures.leaks import assert_llm_idle
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

MAX_NEW_TOKENS = 12
LOGPROB_TOL = 1e-4
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava"]
PLACEHOLDER = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "llava": "<image>",
}


def photo(name: str) -> Image.Image:
    """A real photograph shipped inside an installed package."""
    if name == "grace_hopper":
        import matplotlib

        path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    else:
        import skimage

        path = Path(skimage.__file__).parent / "data" / f"{name}"
    return Image.open(path)


def generated(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt_cases(family: str) -> list[tuple[str, list[Image.Image]]]:
    tag = PLACEHOLDER[family]
    return [
        ("A text-only question about nothing in particular.", []),
        (f"{tag}Describe the image.", [photo("grace_hopper")]),
        (
            f"Compare {tag} with {tag} and {tag} please.",
            [photo("astronaut.png"), generated(300, 90, 1), photo("coffee.png")],
        ),
        (f"Before the picture {tag} and after it, more words.", [generated(64, 200, 2)]),
        (f"{tag}What is here?", [photo("chelsea.png").convert("L")]),
    ]


def qwen2_vl_cases(tmp_path) -> tuple[str, HFVisionReference, list, list[dict]]:
    """A tiny Qwen2-VL checkpoint, its HF reference, ``prompt_cases`` and the same cases as
    ``LLM.generate`` prompts."""
    path = build_tiny_vlm_checkpoint(tmp_path, family="qwen2_vl", seed=3)
    cases = prompt_cases("qwen2_vl")
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases]
    return path, HFVisionReference(path), cases, prompts


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory):
    family = request.param
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp(family), family=family, seed=3)
    return family, path, HFVisionReference(path)


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def legacy_vlm(request, tmp_path_factory):
    family = request.param
    folder = tmp_path_factory.mktemp(f"{family}_legacy")
    path = build_tiny_vlm_checkpoint(folder, family=family, seed=3, layout="legacy")
    return family, path, HFVisionReference(path)


class HFVisionReference:
    def __init__(self, path: str) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    def greedy(self, text: str, images: list[Image.Image]):
        inputs = self.processor(text=[text], images=images or None, return_tensors="pt")
        return self.generate(inputs)

    def greedy_chat(self, messages: list[dict]):
        inputs = self.processor.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        return self.generate(inputs)

    def generate(self, inputs):
        return hf_greedy_generate(self.model, inputs, MAX_NEW_TOKENS)


def assert_no_kv_leak(llm: LLM) -> None:
    assert_llm_idle(llm)


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 8, "block_size": 4},
        {"max_num_batched_tokens": 8, "block_size": 4, "async_scheduling": True},
    ],
)
def test_vlm_greedy_matches_hf(vlm, engine_args):
    family, path, reference = vlm
    llm = LLM(path, **engine_args)
    cases = prompt_cases(family)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for (text, images), output in zip(cases, outputs, strict=True):
        prompt_ids, ref_tokens, ref_logprobs = reference.greedy(text, images)
        assert output.prompt_token_ids == prompt_ids  # placeholders expanded as HF does
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        for step, step_logprobs in enumerate(completion.logprobs):
            for token_id, logprob in step_logprobs.items():
                assert abs(logprob.logprob - ref_logprobs[step, token_id].item()) < LOGPROB_TOL
            top_ids = ref_logprobs[step].topk(5).indices.tolist()
            assert set(top_ids) <= set(step_logprobs)
    assert_no_kv_leak(llm)


def test_chat_with_image_parts(vlm):
    assert_chat_matches_hf(*vlm)


def test_chat_hub_legacy_layout(legacy_vlm):
    assert_chat_matches_hf(*legacy_vlm)


def assert_chat_matches_hf(family: str, path: str, reference: HFVisionReference) -> None:
    """One chat turn with an image part: same prompt tokens (chat template, placeholders) and
    greedy tokens as HF's processor and model on the same folder."""
    llm = LLM(path)
    buffer = io.BytesIO()
    photo("rocket.jpg").save(buffer, format="JPEG")
    image = Image.open(io.BytesIO(buffer.getvalue()))
    url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()

    def conversation(image_part: dict) -> list[dict]:
        question = {"type": "text", "text": "What is this?"}
        return [{"role": "user", "content": [image_part, question]}]

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    messages = conversation({"type": "image_url", "image_url": {"url": url}})
    (output,) = llm.chat(messages, params, use_tqdm=False)
    prompt_ids, ref_tokens, _ = reference.greedy_chat(
        conversation({"type": "image", "image": image})
    )
    assert output.prompt_token_ids == prompt_ids
    assert output.outputs[0].token_ids == ref_tokens
    assert_no_kv_leak(llm)


def test_image_errors(vlm):
    family, path, _ = vlm
    llm = LLM(path, max_pixels=500 * 500, max_model_len=200)
    tag = PLACEHOLDER[family]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    small = generated(40, 40, 0)
    cases = [
        ({"prompt": f"{tag}{tag}two tags", "multi_modal_data": {"image": [small]}}, "placeholder"),
        ({"prompt": "no tag", "multi_modal_data": {"image": [small]}}, "placeholder"),
        (
            {"prompt": f"{tag}big", "multi_modal_data": {"image": [generated(600, 600, 1)]}},
            "max_pixels",
        ),
        (
            {"prompt": f"{tag} " + "word " * 300, "multi_modal_data": {"image": [small]}},
            "maximum length",
        ),
        ({"prompt": f"{tag}x", "multi_modal_data": {"image": [b"not an image"]}}, "image"),
        ({"prompt": f"{tag} spelled out, no image"}, "no image fills"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, params, use_tqdm=False)
    assert_no_kv_leak(llm)
    ok = {"prompt": f"{tag}fine", "multi_modal_data": {"image": [small]}}
    assert llm.generate(ok, params, use_tqdm=False)[0].outputs[0].token_ids
