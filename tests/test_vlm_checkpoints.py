"""VLM checkpoints as HF transformers writes them, and as real ones are shaped.

- The chat template comes from the file ``AutoProcessor`` takes it from (processor_config.json,
  chat_template.json, chat_template.jinja), else from the tokenizer's config.
- A Qwen2-VL and a LLaVA checkpoint saved by the installed transformers serve through a real
  ``mm-serve serve`` process, greedy-identical to HF.
- A checkpoint whose embedding has more rows than its tokenizer has tokens (as Qwen2-VL's
  151936 rows against 151657 tokens) generates ids the tokenizer lacks: they decode to no
  text, greedy tokens still match HF, and the sampler draws over every row.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.encoders.processors import read_chat_template
from mm_serve.frontend.processor import load_tokenizer
from tests.fixtures.server import RemoteServer
from tests.fixtures.vlm_checkpoints import (
    QWEN_VL_CHAT_TEMPLATE,
    build_tiny_vlm_checkpoint,
    tokenizer_size,
)

MAX_NEW_TOKENS = 16
MESSAGES = [{"role": "user", "content": "Hello there"}]


def _render_as_hf(path: Path) -> str | None:
    """The prompt HF's processor renders from the folder (None: it has no template)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    if processor.chat_template is None:
        return None
    return processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


def _render_as_ours(path: Path) -> str:
    tokenizer = load_tokenizer(str(path))
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


def test_chat_template_sources(tmp_path):
    """Each place a checkpoint may keep its template, added in transformers' reverse order of
    precedence: every step changes the rendered prompt, as it does for HF's processor."""
    path = tmp_path
    build_tiny_vlm_checkpoint(path, "qwen2_vl")
    assert read_chat_template(path) == QWEN_VL_CHAT_TEMPLATE  # chat_template.jinja
    assert _render_as_ours(path) == _render_as_hf(path)

    # Older checkpoints' files, by hand: transformers 5 reads both forms but writes neither.
    (path / "chat_template.json").write_text(json.dumps({"chat_template": "json:{{ 1 }}"}))
    assert _render_as_ours(path) == _render_as_hf(path) == "json:1"

    processor_config = json.loads((path / "processor_config.json").read_text())
    named = {"default": "nested:{{ 2 }}", "other": "unused"}
    processor_config["chat_template"] = named
    (path / "processor_config.json").write_text(json.dumps(processor_config))
    assert _render_as_ours(path) == "nested:2"
    assert _render_as_hf(path) == "nested:2"


def test_chat_template_in_tokenizer_config(tmp_path):
    """An older tokenizer save keeps the template in tokenizer_config.json, and no processor
    file has one: HF's processor has none, ours falls back to the tokenizer's (as vLLM)."""
    from transformers import AutoTokenizer

    path = tmp_path
    build_tiny_vlm_checkpoint(path, "llava")
    (path / "chat_template.jinja").unlink()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "tokenizer:{{ messages[0]['content'] }}"
    tokenizer.save_pretrained(path, save_jinja_files=False)
    assert not (path / "chat_template.jinja").exists()
    assert read_chat_template(path) is None
    assert _render_as_hf(path) is None
    assert _render_as_ours(path) == "tokenizer:Hello there"


def test_malformed_chat_template_file(tmp_path):
    (tmp_path / "chat_template.json").write_text('{"chat_template": {"other": "x"}}')
    with pytest.raises(ValueError, match="'default' template"):
        read_chat_template(tmp_path)
    (tmp_path / "chat_template.json").write_text("not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_chat_template(tmp_path)


def _image() -> tuple[Image.Image, str]:
    """A 90x60 RGB image and its PNG data URL (lossless: HF sees the same pixels)."""
    pixels = np.random.default_rng(0).integers(0, 256, (60, 90, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return image, "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@torch.inference_mode()
def _hf_chat(path: str, image: Image.Image, question: str) -> tuple[list[int], str]:
    """HF's greedy completion ids and text for one user turn with ``image`` and ``question``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    content = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    return ids, processor.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(params=["qwen2_vl", "llava"])
def served(request, tmp_path):
    """(checkpoint folder, server URL): for Qwen2-VL the session's shared server on conftest's
    ``vlm_path`` (built the same way), for LLaVA a server of its own."""
    if request.param == "qwen2_vl":
        yield request.getfixturevalue("vlm_path"), request.getfixturevalue("vlm_server").url
        return
    path = build_tiny_vlm_checkpoint(tmp_path, request.param, seed=2)
    with RemoteServer(path, ["--max-model-len", "512", "--num-kv-blocks", "64"]) as server:
        yield path, server.url


def test_serve_transformers_layout(served):
    """``mm-serve serve`` on a folder exactly as transformers' save_pretrained wrote it (no
    preprocessor_config.json): a chat turn with an image answers as HF does."""
    path, server_url = served
    assert not (Path(path) / "preprocessor_config.json").exists()
    image, url = _image()
    question = "What is in the picture?"
    ref_ids, ref_text = _hf_chat(path, image, question)
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": question},
    ]
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_NEW_TOKENS,
        "temperature": 0,
    }
    response = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["usage"]["completion_tokens"] == len(ref_ids)
    assert reply["choices"][0]["message"]["content"] == ref_text.rstrip("\ufffd")


@pytest.fixture(scope="module")
def wide_vocab_path(tmp_path_factory) -> str:
    # Three quarters of the rows are ids the tokenizer lacks: greedy decoding lands on some.
    vocab_size = 4 * tokenizer_size("qwen2_vl")
    return build_tiny_vlm_checkpoint(
        tmp_path_factory.mktemp("wide"), "qwen2_vl", seed=1, vocab_size=vocab_size
    )


def test_vocab_size_below_tokenizer_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="below the tokenizer"):
        build_tiny_vlm_checkpoint(tmp_path, "llava", vocab_size=tokenizer_size("llava") - 1)


@torch.inference_mode()
def test_ids_beyond_the_tokenizer(wide_vocab_path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(wide_vocab_path)
    hf = AutoModelForImageTextToText.from_pretrained(wide_vocab_path, dtype=torch.float32).eval()
    assert hf.config.text_config.vocab_size == 4 * len(tokenizer)
    llm = LLM(wide_vocab_path)
    prompts = ["A harbor town", "The committee met", "Light travels"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    unknown = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt).input_ids
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        completion = output.outputs[0]
        assert completion.token_ids == ref[0, len(ids) :].tolist()
        # An id the tokenizer lacks adds no text (nor does an unfinished UTF-8 character at the
        # end, which the incremental decoder holds back).
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.text == text.rstrip("\ufffd")
        unknown += sum(t >= len(tokenizer) for t in completion.token_ids)
    assert unknown > 0  # the case this test is about did occur
    # Sampling covers every row: with a flat temperature, ids beyond the tokenizer come up.
    sampled = llm.generate(
        prompts[0], SamplingParams(temperature=5.0, max_tokens=64, seed=0, ignore_eos=True)
    )[0].outputs[0]
    assert max(sampled.token_ids) >= len(tokenizer)
