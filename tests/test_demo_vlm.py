"""The bundled demo VLM (samples/demo_vlm/model) answers questions about fresh scenes.

The scenes come from the sample's own generator with a seed used neither in training nor in
its EVAL.md; the answers come greedily from our engine, in trained and in held-out phrasings.
Also checked: the questions people ask first (the README's and the web page's) about
``example.png``, an OpenAI-style ``image_url`` data URL placed after the question, greedy
tokens equal to HF transformers' on the same checkpoint, and the checkpoint's size budget.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import random
import sys
from collections import Counter

import pytest
import torch

from mm_serve import LLM, SamplingParams

DEMO_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "samples", "demo_vlm")
MODEL_DIR = os.path.join(DEMO_DIR, "model")
SEED, PER_TYPE = 7, 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def _load_evaluate():
    """Import the sample's evaluate.py by path (samples/ is not a package); it puts its own
    folder on sys.path and imports its sibling ``scenes``."""
    name = "demo_vlm_evaluate"
    spec = importlib.util.spec_from_file_location(name, os.path.join(DEMO_DIR, "evaluate.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


evaluate = _load_evaluate()
scenes = sys.modules["scenes"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM(MODEL_DIR)
    yield engine
    engine.shutdown()


def test_checkpoint_is_a_small_qwen2_vl():
    size = sum(os.path.getsize(os.path.join(MODEL_DIR, f)) for f in os.listdir(MODEL_DIR))
    assert size <= 25 * 1024 * 1024
    with open(os.path.join(MODEL_DIR, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen2VLForConditionalGeneration"]


def test_answers_each_question_type(llm):
    cases = evaluate.make_cases(SEED, PER_TYPE)
    predictions = evaluate.answer_all(llm, cases)
    right = Counter(
        c.qtype for c, p in zip(cases, predictions, strict=True) if evaluate.is_correct(c, p)
    )
    wrong = [
        (c.question, c.answer, p)
        for c, p in zip(cases, predictions, strict=True)
        if not evaluate.is_correct(c, p)
    ]
    for qtype in scenes.QUESTION_TYPES:
        assert right[qtype] >= PER_TYPE - 1, (qtype, wrong)
    assert sum(right.values()) >= len(cases) - 2, wrong


def test_answers_held_out_phrasings(llm):
    """One fresh scene per held-out phrasing (never trained on): at most one wrong of 12."""
    cases = evaluate.make_cases(SEED + 3, 0, per_phrasing=1)
    predictions = evaluate.answer_all(llm, cases)
    wrong = [
        (c.question, c.answer, p)
        for c, p in zip(cases, predictions, strict=True)
        if not evaluate.is_correct(c, p)
    ]
    assert len(cases) == 2 * len(scenes.QUESTION_TYPES)
    assert len(wrong) <= 1, wrong


@pytest.mark.parametrize(
    "question",
    [
        "What is in the picture?",
        "What's in this image?",
        "What do you see?",
        "Describe this photo.",
    ],
)
def test_describes_the_example_image(llm, question):
    """The README's and the web page's first question, and its everyday variants, about
    example.png (``generate_scene(Random(0))``) sent as a PNG data URL: the full description."""
    with open(os.path.join(DEMO_DIR, "example.png"), "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": question},
    ]
    (reply,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    expected = scenes.describe(scenes.generate_scene(random.Random(0)))
    assert expected.startswith("The image shows 2 large yellow circles")
    assert reply.outputs[0].text.strip() == expected
    assert reply.outputs[0].finish_reason == "stop"


def test_image_url_after_the_question(llm):
    scene = scenes.generate_scene(random.Random(SEED + 1))
    buffer = io.BytesIO()
    scene.image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [
        {"type": "text", "text": "What is written on the sign?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    (reply,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    assert reply.outputs[0].text.strip() == scene.word
    assert reply.outputs[0].finish_reason == "stop"


@torch.inference_mode()
def test_greedy_tokens_match_hf(llm):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(MODEL_DIR)
    model = Qwen2VLForConditionalGeneration.from_pretrained(
        MODEL_DIR, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cases = evaluate.make_cases(SEED + 2, 1, types=("describe", "count"))
    ours = llm.chat([evaluate.conversation(c) for c in cases], GREEDY, use_tqdm=False)
    for case, output in zip(cases, ours, strict=True):
        messages = [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": case.question}],
            }
        ]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=[prompt], images=[case.image], return_tensors="pt")
        generated = model.generate(**inputs, max_new_tokens=64, do_sample=False)
        theirs = generated[0, inputs["input_ids"].shape[1] :].tolist()
        assert list(output.outputs[0].token_ids) == theirs
