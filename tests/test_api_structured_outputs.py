"""Structured outputs and ``logit_bias`` over HTTP, with the official ``openai`` package against
a real ``mm-serve serve`` subprocess (a tiny random-weight Qwen2-VL): whatever the random model
prefers, every output obeys its constraint."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from mm_serve import SamplingParams
from tests.fixtures.server import VLM_SERVED_NAME as MODEL

USER = [{"role": "user", "content": "Describe a cat."}]
SCHEMA = {
    "type": "object",
    "properties": {
        # Not maxLength: xgrammar 0.2.8 then lets raw control characters into the string.
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "pet": {"type": "boolean"},
        "colour": {"enum": ["black", "white", "tabby"]},
    },
    "required": ["name", "legs", "pet", "colour"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def client(vlm_openai):
    """The session's shared server (conftest's ``vlm_server``)."""
    return vlm_openai


def _chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 60)
    return client.chat.completions.create(model=MODEL, messages=USER, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_response_validates(client, temperature) -> None:
    response = _chat(client, response_format=RESPONSE_FORMAT, temperature=temperature, n=2)
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_schema_streamed(client) -> None:
    stream = _chat(client, response_format=RESPONSE_FORMAT, stream=True, seed=3, temperature=1)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(client) -> None:
    response = _chat(client, response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_regex_choice_and_grammar_on_both_endpoints(client) -> None:
    regex = {"structured_outputs": {"regex": r"(cat|dog)-[0-9]{2}"}}
    choice = {"structured_outputs": {"choice": ["yes", "no", 'a "quoted" one']}}
    grammar = {"structured_outputs": {"grammar": 'root ::= "A" ("b" | "c")* "!"'}}
    for extra_body, check in [
        (regex, lambda text: re.fullmatch(r"(cat|dog)-[0-9]{2}", text)),
        (choice, lambda text: text in choice["structured_outputs"]["choice"]),
        (grammar, lambda text: re.fullmatch(r"A[bc]*!", text)),
    ]:
        chat = _chat(client, extra_body=extra_body, n=3, temperature=1.0, seed=1)
        texts = [c.message.content for c in chat.choices]
        completion = client.completions.create(
            model=MODEL, prompt="Name:", max_tokens=60, extra_body=extra_body
        )
        texts.append(completion.choices[0].text)
        assert all(check(text) for text in texts), texts


def test_with_and_without_grammars_in_one_batch(client, vlm_llm) -> None:
    """Concurrent requests share steps; the plain ones are the same as alone."""
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = vlm_llm.chat(USER, greedy)[0].outputs[0].text
    with ThreadPoolExecutor(8) as pool:
        plain = [pool.submit(_chat, client, temperature=0, max_tokens=12) for _ in range(4)]
        constrained = [
            pool.submit(_chat, client, response_format=RESPONSE_FORMAT) for _ in range(4)
        ]
        assert [f.result().choices[0].message.content for f in plain] == [alone] * 4
        for future in constrained:
            jsonschema.validate(json.loads(future.result().choices[0].message.content), SCHEMA)


def test_logit_bias_forces_one_token(client) -> None:
    completion = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=8,
        temperature=1.0,
        logit_bias={"42": 100},
        extra_body={"return_token_ids": True},
    )
    assert completion.choices[0].token_ids == [42] * 8


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },  # fmt: skip
            "response_format",
            "objectx",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs", "["),
        (
            {"extra_body": {"structured_outputs": {"grammar": "root ::= "}}},
            "structured_outputs",
            "EBNF",
        ),  # fmt: skip
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
            "structured_outputs",
            "exactly one",
        ),  # fmt: skip
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "bogus": 1}}},
            "structured_outputs",
            "bogus",
        ),  # fmt: skip
        (
            {
                "response_format": {"type": "json_object"},
                "extra_body": {"structured_outputs": {"regex": "a"}},
            },
            "structured_outputs",
            "not both",
        ),  # fmt: skip
        ({"logit_bias": {"999999": 5}}, "logit_bias", "token ids must be in"),
        ({"logit_bias": {"x": 5}}, "logit_bias", "token ids"),
        ({"logit_bias": {"3": 101}}, None, "[-100, 100]"),
    ],
)
def test_invalid_constraints_are_400(client, kwargs, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **kwargs)
    error = info.value.body
    assert message in error["message"], error
    if param is not None:
        assert error["param"].startswith(param), error
    # The server still serves.
    still = _chat(client, max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert still.choices[0].finish_reason == "length"
