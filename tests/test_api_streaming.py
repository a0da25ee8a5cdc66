"""Streaming as OpenAI clients count it, and request-shape errors as OpenAI answers them.

A real ``mm-serve serve`` on a tiny Qwen2-VL whose embedding has more rows than its tokenizer
has tokens (as real checkpoints have), so that sampled tokens include ids the tokenizer lacks,
special tokens and halves of multi-byte characters: tokens without text of their own.

vLLM's ``bench serve`` (openai-chat) counts a chunk as a token when its delta's ``content`` is
non-empty, or is ``""`` with no ``role`` key; a stream with no such chunk "Never received a
valid chunk". Each test checks that the token chunks are exactly the completion's tokens.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import openai
import pytest
from PIL import Image
from pydantic import ValidationError

from mm_serve.entrypoints.openai.errors import validation_error
from mm_serve.entrypoints.openai.protocol import ChatCompletionRequest
from tests.fixtures.server import serve_checked
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint, tokenizer_size

EXTRA_ROWS = 300  # embedding rows beyond the tokenizer: about 40% of the ids decode to nothing
MAX_TOKENS = 24
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def png_url(size: tuple[int, int] = (64, 48)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, (30, 120, 200)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": png_url()}},
            {"type": "text", "text": "What is in the picture?"},
        ],
    }
]
# Sampled (seeded) and without EOS, so the output wanders over the whole vocabulary.
SAMPLED = {"temperature": 1.0, "seed": 3, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    vocab_size = tokenizer_size("qwen2_vl") + EXTRA_ROWS
    path = build_tiny_vlm_checkpoint(
        tmp_path_factory.mktemp("wide_vocab"), "qwen2_vl", seed=2, vocab_size=vocab_size
    )
    args = ["--max-model-len", "256", "--num-kv-blocks", "64", "--mm-preprocess-workers", "1"]
    yield from serve_checked(path, args)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """The JSON of every SSE event of a streamed request, in order; the stream must end with
    ``data: [DONE]``."""
    found, done = [], False
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            assert not done, "an event after [DONE]"
            if line == "data: [DONE]":
                done = True
            else:
                found.append(json.loads(line.removeprefix("data: ")))
    assert done
    return found


def is_token_chunk(choice: dict) -> bool:
    """vLLM's ``bench serve`` rule for a chat chunk that carries a token."""
    delta = choice["delta"]
    return bool(delta.get("content")) or (delta.get("content") == "" and "role" not in delta)


def token_ids(entries: list[dict]) -> list[int]:
    """Token ids of logprobs entries named ``token_id:<id>``."""
    return [int(entry["token"].removeprefix("token_id:")) for entry in entries]


def check_chat_chunks(chunks: list[dict]) -> dict[int, list[dict]]:
    """The contract of every chat chunk with choices: one choice, a delta without nulls, the
    role alone in each choice's first chunk and nowhere else, a token per later chunk but a
    bare finish. Returns each choice's token chunks."""
    tokens: dict[int, list[dict]] = {}
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert len(chunk["choices"]) == 1, chunk
        choice = chunk["choices"][0]
        delta, index = choice["delta"], choice["index"]
        assert None not in delta.values() and set(delta) <= {"role", "content"}, delta
        if index not in tokens:
            assert delta == {"role": "assistant", "content": ""}, chunk
            assert choice["finish_reason"] is None
            tokens[index] = []
            continue
        assert "role" not in delta, chunk
        if is_token_chunk(choice):
            tokens[index].append(choice)
        else:
            assert delta == {} and choice["finish_reason"], chunk
    return tokens


def test_chat_stream_has_a_chunk_per_token(http):
    body = {"messages": MESSAGES, **SAMPLED, "logprobs": True, "return_tokens_as_token_ids": True}
    chunks = events(http, CHAT, {**body, "stream_options": {"include_usage": True}})
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == MAX_TOKENS
    (tokens,) = check_chat_chunks(chunks[:-1]).values()
    assert len(tokens) == usage["completion_tokens"]
    # Each token chunk carries its own token, and some tokens have no text of their own.
    assert all(len(c["logprobs"]["content"]) == 1 for c in tokens)
    streamed_ids = [token_ids(c["logprobs"]["content"])[0] for c in tokens]
    assert any(c["delta"]["content"] == "" for c in tokens)
    assert any(t >= tokenizer_size("qwen2_vl") for t in streamed_ids)
    assert tokens[-1]["finish_reason"] == "length"
    # The same seeded request unstreamed: the same tokens and text.
    reply = http.post(CHAT, json=body).json()
    assert token_ids(reply["choices"][0]["logprobs"]["content"]) == streamed_ids
    text = "".join(c["delta"]["content"] for c in tokens)
    assert text == reply["choices"][0]["message"]["content"]


def test_chat_stream_n3_one_choice_per_chunk(http):
    body = {"messages": MESSAGES, **SAMPLED, "n": 3, "logprobs": True}
    chunks = events(http, CHAT, {**body, "return_tokens_as_token_ids": True})
    assert all(chunk.get("usage") is None for chunk in chunks)  # include_usage not asked
    tokens = check_chat_chunks(chunks)
    reply = http.post(CHAT, json={**body, "return_tokens_as_token_ids": True}).json()
    assert sorted(tokens) == [0, 1, 2]
    assert reply["usage"]["completion_tokens"] == sum(map(len, tokens.values())) == 3 * MAX_TOKENS
    for choice in reply["choices"]:
        streamed = [token_ids(c["logprobs"]["content"])[0] for c in tokens[choice["index"]]]
        assert streamed == token_ids(choice["logprobs"]["content"])


def test_completions_stream_has_a_chunk_per_token(http):
    body = {"prompt": ["Once upon", "In a land"], **SAMPLED, "n": 2, "logprobs": 0}
    body["stream_options"] = {"include_usage": True}
    chunks = events(http, COMPLETIONS, body)
    usage = chunks.pop()["usage"]
    per_choice: dict[int, list[dict]] = {}
    for chunk in chunks:
        assert chunk["object"] == "text_completion" and len(chunk["choices"]) == 1, chunk
        choice = chunk["choices"][0]
        assert len(choice["logprobs"]["tokens"]) == 1  # exactly one token per chunk
        per_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(per_choice) == [0, 1, 2, 3]
    assert all(len(c) == MAX_TOKENS for c in per_choice.values())
    assert usage["completion_tokens"] == 4 * MAX_TOKENS
    assert [c[-1]["finish_reason"] for c in per_choice.values()] == ["length"] * 4
    assert any(c["text"] == "" for choices in per_choice.values() for c in choices)


def test_openai_package_streams(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kwargs = {"model": client.models.list().data[0].id, "messages": MESSAGES, **SAMPLED}
    kwargs["extra_body"] = {"ignore_eos": kwargs.pop("ignore_eos")}
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    reply = client.chat.completions.create(**kwargs)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens == MAX_TOKENS
    assert len([c for c in chunks if c.choices]) == 1 + MAX_TOKENS  # the role, then tokens


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_options(http, path):
    body = {"max_tokens": 3}
    body |= {"messages": MESSAGES} if path == CHAT else {"prompt": "Hello"}
    for stream in (False, None, "absent"):
        for options in ({"include_usage": True}, {"include_usage": None}, {}):
            sent = {**body, "stream_options": options}
            if stream != "absent":
                sent["stream"] = stream
            response = http.post(path, json=sent)
            assert response.status_code == 400, (sent, response.text)
            error = response.json()["error"]
            assert error["param"] == "stream_options" and error["type"] == "invalid_request_error"
    # Streaming, include_usage null is false: no usage chunk.
    chunks = events(http, path, {**body, "stream_options": {"include_usage": None}})
    assert all(chunk["choices"] and chunk.get("usage") is None for chunk in chunks)


@pytest.mark.parametrize(
    ("content", "param", "code"),
    [
        ([{"type": "image_url", "image_url": "http://x/a.png"}], "content[0].image_url", None),
        ([{"type": "image_url", "image_url": {"url": 5}}], "content[0].image_url.url", None),
        ([{"type": "image_url", "image_url": {}}], "content[0].image_url.url", "missing"),
        ([{"type": "text", "text": "a"}, {"type": "image_url"}], "content[1].image_url", "missing"),
        (5, "content", None),
    ],
)
def test_wrong_shape_is_400_naming_the_field(http, content, param, code):
    response = http.post(CHAT, json={"messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == f"messages[0].{param}"
    assert error["code"] == ("missing_required_parameter" if code else "invalid_type")
    assert error["param"] in error["message"]


def test_missing_field_and_bad_json_are_400(http):
    for path, field in ((CHAT, "messages"), (COMPLETIONS, "prompt")):
        error = http.post(path, json={"max_tokens": 2}).json()["error"]
        assert (error["param"], error["code"]) == (field, "missing_required_parameter")
    headers = {"content-type": "application/json"}
    response = http.post(CHAT, content=b'{"messages": [', headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_param_names_without_union_labels():
    """pydantic reports a failed union once per member, labelled (``str``,
    ``list[tagged-union[...]]``) and tagged; the error names the field as OpenAI does."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}], "n": "x"}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    error = validation_error(info.value.errors()).body()["error"]
    assert error["param"] == "n"
    assert "messages[0].content[0].text: Input should be a valid string" in error["message"]
    assert "str" not in error["message"].replace("string", "")  # no member label left
