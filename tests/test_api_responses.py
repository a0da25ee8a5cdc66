"""The Responses API (``/v1/responses``) with the official ``openai`` package against the
session's ``mm-serve serve`` (a tiny random-weight Qwen2-VL): a response answers as a chat
completion of the same prompt, streamed or not; ``previous_response_id`` continues a stored
conversation; ``text.format`` JSON schemas hold; what is not served is a 400 naming it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.fixtures.server import VLM_SERVED_NAME as MODEL
from tests.fixtures.server import noise_png_url

IMAGE = noise_png_url(11, 56, 84)
QUESTION = "What is in this picture?"
IMAGE_INPUT = [
    {
        "role": "user",
        "content": [
            {"type": "input_image", "image_url": IMAGE},
            {"type": "input_text", "text": QUESTION},
        ],
    }
]
IMAGE_CHAT = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": IMAGE}},
            {"type": "text", "text": QUESTION},
        ],
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}, "count": {"type": "integer"}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(vlm_openai):
    return vlm_openai


def chat_text(client, messages, max_tokens=12) -> str:
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return response.choices[0].message.content


def test_an_image_response_answers_as_chat(client):
    response = client.responses.create(
        model=MODEL, input=IMAGE_INPUT, max_output_tokens=12, temperature=0
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == (
        "max_output_tokens"
    )
    assert response.output_text == chat_text(client, IMAGE_CHAT)
    assert response.usage.output_tokens == 12
    assert response.output[0].role == "assistant" and response.id.startswith("resp_")
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_instructions_are_a_system_message(client):
    response = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input="Hello there", max_output_tokens=8,
        temperature=0,
    )  # fmt: skip
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello there"},
    ]
    assert response.output_text == chat_text(client, messages, 8)


def test_a_stream_sends_the_events_and_the_same_text(client):
    """Stopped by max_output_tokens, the stream ends with response.incomplete (as OpenAI's,
    which the SDK's get_final_response does not take)."""
    expected = client.responses.create(
        model=MODEL, input=IMAGE_INPUT, max_output_tokens=12, temperature=0
    )
    with client.responses.stream(
        model=MODEL, input=IMAGE_INPUT, max_output_tokens=12, temperature=0
    ) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == events[-1].response.output_text == expected.output_text
    assert events[-1].response.id == events[0].response.id
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_a_completed_stream_gives_the_final_response(client):
    fields = {
        "model": MODEL,
        "input": "Describe a ball as JSON.",
        "max_output_tokens": 60,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "ball", "schema": SCHEMA}},
    }
    with client.responses.stream(**fields) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == client.responses.create(**fields).output_text
    jsonschema.validate(json.loads(final.output_text), SCHEMA)


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(
        model=MODEL, input=IMAGE_INPUT, max_output_tokens=6, temperature=0
    )
    follow_up = client.responses.create(
        model=MODEL, input="And the colours?", previous_response_id=first.id,
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    messages = [
        *IMAGE_CHAT,
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And the colours?"},
    ]
    assert follow_up.output_text == chat_text(client, messages, 8)
    assert follow_up.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_store_false_stores_nothing(client):
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Again", previous_response_id=unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_json_schema_output_validates(client):
    response = client.responses.create(
        model=MODEL, input="Describe a ball as JSON.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "ball", "schema": SCHEMA}},
    )  # fmt: skip
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
         "input[0].content[0].file_id"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_it(client, fields, param):
    body = {"model": MODEL, "input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", body=body, cast_to=object)
    assert caught.value.body["param"] == param
