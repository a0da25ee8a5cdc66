"""vLLM's chat extensions over HTTP: ``add_generation_prompt``, ``continue_final_message``,
``echo``, ``chat_template_kwargs``, ``mm_processor_kwargs`` (per request and
``--mm-processor-kwargs``), OpenAI's ``detail`` of an image and its ``temperature`` range,
against a real ``mm-serve serve`` subprocess (a tiny Qwen2-VL). Prompts are checked against
HF's processor on the same checkpoint, which takes the same ``max_pixels``/``min_pixels``."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.fixtures.server import http_client
from tests.fixtures.vlm_checkpoints import (
    QWEN_MIN_PIXELS,
    QWEN_VL_CHAT_TEMPLATE,
    build_tiny_vlm_checkpoint,
)

MODEL = "tiny-vlm"
MAX_MODEL_LEN = 1024
# The server's image budget, above the checkpoint's (64 tokens) and above detail "low"'s.
SERVER_MAX_PIXELS = 28 * 28 * 512
LOW_DETAIL_MAX_PIXELS = 448 * 448
QUESTION = "What is in this picture?"
# The checkpoint's template, and Qwen3's way to skip thinking when told (enable_thinking).
TEMPLATE = QWEN_VL_CHAT_TEMPLATE + (
    "{%- if add_generation_prompt and enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=7)


@pytest.fixture(scope="module")
def http(vlm_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(TEMPLATE)
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256"]
    args += ["--chat-template", str(template)]
    args += ["--served-model-name", MODEL]
    args += ["--mm-processor-kwargs", json.dumps({"max_pixels": SERVER_MAX_PIXELS})]
    yield from http_client(vlm_path, args)


@pytest.fixture(scope="module")
def processor(vlm_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm_path)


def _image() -> Image.Image:
    """900 x 700: more pixels than the server's budget, which then bounds its tokens."""
    ramp = np.linspace(0, 255, 900, dtype=np.uint8)
    pixels = np.stack([np.tile(ramp, (700, 1))] * 3, -1)
    pixels[:, :, 1] = np.linspace(0, 255, 700, dtype=np.uint8)[:, None]
    return Image.fromarray(pixels)


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


IMAGE = _image()
IMAGE_URL = _data_url(IMAGE)


def image_messages(detail: str | None = None) -> list[dict]:
    image_url = {"url": IMAGE_URL} | ({"detail": detail} if detail else {})
    content = [{"type": "image_url", "image_url": image_url}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": content}]


def chat(http: httpx.Client, messages: list[dict], **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    return http.post("/v1/chat/completions", json=body | fields)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def hf_prompt(processor, min_pixels: int | None = None, max_pixels: int | None = None) -> list[int]:
    """HF's prompt for ``image_messages()``: the image expanded as its processor does with
    these bounds (vLLM passes mm_processor_kwargs to it; transformers now names them
    ``size``); without ``min_pixels``, the checkpoint's, lowered to ``max_pixels``."""
    image_kwargs = {}
    if max_pixels is not None:
        low = min(QWEN_MIN_PIXELS, max_pixels) if min_pixels is None else min_pixels
        image_kwargs["size"] = {"shortest_edge": low, "longest_edge": max_pixels}
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    return list(processor(text=[text], images=[IMAGE], **image_kwargs).input_ids[0])


def prompt_ids(reply: dict) -> list[int]:
    return reply["prompt_token_ids"]


# ---- add_generation_prompt, continue_final_message, echo ------------------------------------

CONTINUED = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "The picture shows"},
]


def test_an_earlier_reply_sent_back_as_the_sdk_dumps_it(http):
    """The OpenAI SDK's dump of an assistant reply carries audio, function_call, refusal, ...
    as null: the same prompt as without them. Non-null audio is a 400 (tested with the bad
    inputs)."""
    sdk_fields = {"refusal": None, "audio": None, "function_call": None, "annotations": None}
    turns = [*CONTINUED, {"role": "user", "content": "And then?"}]
    dumped = [turns[0], turns[1] | sdk_fields, turns[2]]
    plain = ok(chat(http, turns, return_token_ids=True))
    assert prompt_ids(ok(chat(http, dumped, return_token_ids=True))) == prompt_ids(plain)


def test_continue_final_message_leaves_the_turn_open_as_hf(http, processor):
    """The prompt is HF's rendering with continue_final_message (no end of turn after the
    assistant's text); echo prefixes the reply with that text, in a response and a stream."""
    fields = dict(add_generation_prompt=False, continue_final_message=True)
    plain = ok(chat(http, CONTINUED, return_token_ids=True, **fields))
    text = processor.apply_chat_template(CONTINUED, tokenize=False, **fields)
    assert text.endswith("The picture shows")
    assert prompt_ids(plain) == processor.tokenizer(text).input_ids
    generated = plain["choices"][0]["message"]["content"]
    echoed = ok(chat(http, CONTINUED, echo=True, **fields))["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": "The picture shows" + generated}

    body = {"model": MODEL, "messages": CONTINUED, "max_tokens": 4, "temperature": 0}
    body |= fields | {"echo": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "The picture shows"}
    assert "".join(d.get("content", "") for d in deltas) == echoed["content"]


def test_without_a_generation_prompt_the_reply_continues_the_last_role(http, processor):
    """vLLM's: no generation prompt, the reply is in the last message's role (echoed with
    echo); with one, echo has nothing of the assistant's to repeat."""
    messages = [{"role": "user", "content": "Hello"}]
    reply = ok(chat(http, messages, add_generation_prompt=False, return_token_ids=True))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert prompt_ids(reply) == processor.tokenizer(text).input_ids
    message = reply["choices"][0]["message"]
    assert message["role"] == "user"
    echoed = ok(chat(http, messages, add_generation_prompt=False, echo=True))
    assert echoed["choices"][0]["message"]["content"] == "Hello" + message["content"]
    default = ok(chat(http, messages))["choices"][0]["message"]
    assert ok(chat(http, messages, echo=True))["choices"][0]["message"] == default
    assert default["role"] == "assistant"


def test_chat_template_kwargs_reach_the_template_as_hf(http, processor):
    messages = [{"role": "user", "content": "Hello"}]
    kwargs = {"enable_thinking": False}
    reply = ok(chat(http, messages, chat_template_kwargs=kwargs, return_token_ids=True))
    text = processor.apply_chat_template(
        messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert text.endswith("<think>\n\n</think>\n\n")
    assert prompt_ids(reply) == processor.tokenizer(text).input_ids
    plain = ok(chat(http, messages, chat_template_kwargs={}, return_token_ids=True))
    assert prompt_ids(plain) == prompt_ids(reply)[: len(prompt_ids(plain))]
    assert len(prompt_ids(plain)) < len(prompt_ids(reply))
    for taken in ({"add_generation_prompt": False}, {"messages": []}, {"tokenize": True}):
        response = chat(http, messages, chat_template_kwargs=taken)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "chat_template_kwargs" and next(iter(taken)) in error["message"]


# ---- mm_processor_kwargs and detail --------------------------------------------------------


def test_server_mm_processor_kwargs_and_image_detail_as_hf(http, processor):
    """--mm-processor-kwargs sets every image's budget (above the checkpoint's); detail "low"
    caps it at 448 x 448 pixels; "high" and "auto" are the server's."""
    server = hf_prompt(processor, max_pixels=SERVER_MAX_PIXELS)
    assert len(server) > len(hf_prompt(processor)) + 300  # the flag did raise the budget
    for detail in (None, "high", "auto"):
        reply = ok(chat(http, image_messages(detail), max_tokens=1, return_token_ids=True))
        assert prompt_ids(reply) == server, detail
    low = ok(chat(http, image_messages("low"), max_tokens=1, return_token_ids=True))
    assert prompt_ids(low) == hf_prompt(processor, max_pixels=LOW_DETAIL_MAX_PIXELS)
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert 0 < prompt_ids(low).count(image_token_id) <= 256


def test_request_mm_processor_kwargs_as_hf_and_apart_in_the_caches(http, processor):
    """A request's max_pixels/min_pixels resize its images as HF's processor does with them,
    and their cache entries are their own: the same image under other settings is encoded
    again (cached_images 0), under the same settings it is not (cached_images 1)."""
    small = {"max_pixels": 28 * 28 * 16}
    ok(chat(http, image_messages(), max_tokens=1))  # the server's settings: now cached
    for kwargs in (small, small | {"min_pixels": 28 * 28 * 8}, {"max_pixels": 28 * 28 * 100}):
        first = chat(http, image_messages(), mm_processor_kwargs=kwargs, return_token_ids=True)
        first = ok(first)
        expected = hf_prompt(processor, **{"max_pixels": SERVER_MAX_PIXELS} | kwargs)
        assert prompt_ids(first) == expected, kwargs
        assert first["usage"]["prompt_tokens_details"]["cached_images"] == 0, kwargs
        again = ok(chat(http, image_messages(), mm_processor_kwargs=kwargs))
        assert again["usage"]["prompt_tokens_details"]["cached_images"] == 1, kwargs
        assert again["choices"][0]["message"] == first["choices"][0]["message"]


@pytest.mark.parametrize(
    ("fields", "param", "phrase"),
    [
        ({"mm_processor_kwargs": {"max_pixel": 1000}}, "mm_processor_kwargs", "max_pixel"),
        ({"mm_processor_kwargs": {"max_pixels": -1}}, "mm_processor_kwargs", "max_pixels"),
        ({"mm_processor_kwargs": {"max_pixels": "big"}}, "mm_processor_kwargs", "max_pixels"),
        (
            {"mm_processor_kwargs": {"min_pixels": 10**6, "max_pixels": 10**5}},
            "mm_processor_kwargs",
            "min_pixels",
        ),
        # More tokens than the server's largest image (which sizes the encoder budgets).
        ({"mm_processor_kwargs": {"max_pixels": 28 * 28 * 2000}}, "mm_processor_kwargs", "tokens"),
        ({"mm_processor_kwargs": [1]}, "mm_processor_kwargs", "dict"),
    ],
)
def test_bad_mm_processor_kwargs_are_400s_naming_them(http, fields, param, phrase):
    response = chat(http, image_messages(), **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and phrase in error["message"], error


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
NO_TURN_TO_CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": image_messages("medium")}, "messages[0].content[0].image_url.detail"),
        (CHAT, {"messages": CONTINUED, "continue_final_message": True}, "continue_final_message"),
        (CHAT, {"messages": CONTINUED[:1]} | NO_TURN_TO_CONTINUE, "continue_final_message"),
        (CHAT, {"messages": CONTINUED, "temperature": 2.5}, "temperature"),
        (CHAT, {"messages": CONTINUED, "temperature": -0.1}, "temperature"),
        (COMPLETIONS, {"prompt": "hi", "temperature": 2.01}, "temperature"),
        (COMPLETIONS, {"prompt": "hi", "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
        (COMPLETIONS, {"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
    ],
)
def test_bad_values_are_400s_naming_the_field(http, path, body, param):
    response = http.post(path, json={"model": MODEL, "max_tokens": 2} | body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_temperature_two_is_accepted(http):
    reply = ok(chat(http, CONTINUED[:1], temperature=2.0, seed=1))
    assert reply["usage"]["completion_tokens"] == 4
