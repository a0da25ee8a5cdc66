"""vLLM's ``/tokenize``, ``/detokenize`` and ``/version``, and ``GET /v1/models/{model}``,
against a real ``mm-serve serve`` subprocess (a tiny Qwen2-VL), checked against HF's tokenizer
and processor on the same checkpoint."""

from __future__ import annotations

import base64
import importlib.metadata
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.fixtures.server import VLM_MAX_MODEL_LEN as MAX_MODEL_LEN
from tests.fixtures.server import VLM_SERVED_NAME as MODEL


@pytest.fixture(scope="module")
def base_url(vlm_server):
    """The session's shared server on conftest's ``vlm_path``."""
    return vlm_server.url


def _image() -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, (90, 120, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_tokenize_text_as_hf(base_url, vlm_path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_path)
    text = "Hello there, what is in the picture?"
    for special in (True, False):
        body = {"model": MODEL, "prompt": text, "add_special_tokens": special}
        reply = httpx.post(f"{base_url}/tokenize", json={**body, "return_token_strs": True})
        assert reply.status_code == 200, reply.text
        data = reply.json()
        expected = tokenizer(text, add_special_tokens=special).input_ids
        assert data["tokens"] == expected and data["count"] == len(expected)
        assert data["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
        assert data["max_model_len"] == MAX_MODEL_LEN
    reply = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": expected})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": tokenizer.decode(expected)}


def test_tokenize_chat_with_an_image_as_hf_processor(base_url, vlm_path) -> None:
    """The image expands to its placeholder tokens as HF's processor expands it, and the
    count is the prompt a chat completion of the same messages is charged for."""
    from transformers import AutoProcessor

    image = _image()
    question = "Describe the picture."
    content = [{"type": "image_url", "image_url": {"url": _data_url(image)}}]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": question}]}]
    reply = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": messages})
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["tokens"]

    processor = AutoProcessor.from_pretrained(vlm_path)
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    assert tokens == list(processor(text=[text], images=[image]).input_ids[0])

    chat = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 1},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens)

    no_prompt = {"model": MODEL, "messages": messages, "add_generation_prompt": False}
    shorter = httpx.post(f"{base_url}/tokenize", json=no_prompt).json()["tokens"]
    assert len(shorter) < len(tokens) and tokens[: len(shorter)] == shorter


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "hi", "echo": True}, "echo"),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
        ("/tokenize", {"prompt": "hi", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/tokenize", {"messages": []}, "messages"),
    ],
)
def test_bad_requests_name_their_field(base_url, path, body, param) -> None:
    reply = httpx.post(f"{base_url}{path}", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_field_unknown_to_openai_and_vllm_is_accepted(base_url) -> None:
    plain = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "hi"})
    body = {"model": MODEL, "prompt": "hi", "no_such_field": 1}
    reply = httpx.post(f"{base_url}/tokenize", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == plain.json()["tokens"]


def test_unknown_model_is_404(base_url) -> None:
    reply = httpx.post(f"{base_url}/tokenize", json={"model": "nope", "prompt": "hi"})
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"
    reply = httpx.get(f"{base_url}/v1/models/nope")
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"


def test_retrieve_model_and_version(base_url) -> None:
    card = httpx.get(f"{base_url}/v1/models/{MODEL}")
    assert card.status_code == 200, card.text
    listed = httpx.get(f"{base_url}/v1/models").json()["data"]
    same_fields = {key: value for key, value in card.json().items() if key != "created"}
    listed_card = next(c for c in listed if c["id"] == MODEL)
    assert same_fields == {key: value for key, value in listed_card.items() if key != "created"}
    version = httpx.get(f"{base_url}/version")
    assert version.json() == {"version": importlib.metadata.version("mm_serve")}
