"""Tool calling with the official ``openai`` package against a real ``mm-serve serve``
subprocess (a tiny random-weight Qwen2-VL, a Hermes-style tool template given with
``--chat-template``): enforced calls validate against their function's schema, streamed and
not; assistant calls and tool results render through the template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from mm_serve.entrypoints.openai.tool_calls import HermesToolParser, ToolCallStream, ToolMode
from tests.fixtures.server import openai_client

MODEL = "tiny-vlm"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "Weather in Paris?"}]
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    '{%- for call in message.tool_calls %}<tool_call>\n{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}'
    "<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{%- else %}"
    "{%- for part in message.content %}{%- if part.type in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{%- elif part.type == 'text' %}{{ part.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def client(vlm_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    args = ["--max-model-len", "1024", "--num-kv-blocks", "128", "--chat-template", str(template)]
    yield from openai_client(vlm_path, args, MODEL)


def _chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 300)
    return client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, **kwargs)


def _check_calls(calls, names) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream):
    """The calls a stream delivers, its finish reason and its content."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return list(calls.values()), finish, content


@pytest.mark.parametrize("parallel", [None, False])
def test_required_calls_validate(client, parallel) -> None:
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    response = _chat(client, tool_choice="required", temperature=1.0, seed=2, n=3, **extra)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls, SCHEMAS)
        if parallel is False:
            assert len(choice.message.tool_calls) == 1


def test_named_function_call_validates(client) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    response = _chat(client, tool_choice=choice, temperature=1.0, seed=4)
    (call,) = response.choices[0].message.tool_calls
    assert response.choices[0].finish_reason == "stop"  # OpenAI's and vLLM's for a named call
    _check_calls([call], {"get_time"})


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_calls_validate(client, tool_choice) -> None:
    calls, finish, content = _streamed_calls(
        _chat(client, tool_choice=tool_choice, stream=True, temperature=1.0, seed=1)
    )
    assert calls and content == ""
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")
    for call in calls:
        assert call["id"] and call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_choice_none_is_text(client) -> None:
    response = _chat(
        client, tool_choice="none", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    message = response.choices[0].message
    assert message.content and not message.tool_calls
    assert response.choices[0].finish_reason == "length"


def test_calls_and_results_render_through_the_template(client, vlm_path) -> None:
    messages = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=2,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    prompt = AutoTokenizer.from_pretrained(vlm_path).decode(response.prompt_token_ids)
    assert '"name": "get_weather"' in prompt  # the tool list
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n21 degrees\n</tool_response>" in prompt


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),  # fmt: skip
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_invalid_tool_requests_are_400(client, kwargs, param) -> None:
    tools = kwargs.pop("tools", TOOLS)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2, **({"tools": tools} if tools else {}),
            **kwargs,
        )  # fmt: skip
    assert info.value.body["param"].startswith(param), info.value.body


def test_hermes_parser_and_auto_stream() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
    text += "</tool_call>"
    content, calls = HermesToolParser().extract(text)
    assert content == "Let me look." and calls[0].name == "get_time"
    assert json.loads(calls[0].arguments) == {"zone": "UTC"}
    assert HermesToolParser().extract("<tool_call>not json</tool_call>")[1] == []
    # A stream holds back what may open a call, then sends the calls with the finish.
    stream = ToolCallStream(ToolMode("auto", parser=HermesToolParser()))
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    deltas = [d for p in pieces[:-1] for d in stream.deltas(p, finished=False)]
    deltas += stream.deltas(pieces[-1], finished=True)
    streamed = "".join(d.content or "" for d in deltas)
    assert streamed.strip() == "Let me look." and "<tool" not in streamed
    (last,) = [d for d in deltas if d.tool_calls]
    assert last.tool_calls[0].function.name == "get_time"
