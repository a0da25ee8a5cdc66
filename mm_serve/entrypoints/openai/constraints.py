"""The request fields that constrain the output: OpenAI's ``response_format``, ``logit_bias``
and ``tool_choice`` (``required`` or a named function, from ``tool_calls.ToolMode``), vLLM's
``structured_outputs``; they become ``SamplingParams`` fields."""

from __future__ import annotations

import json
from typing import Any

from mm_serve.entrypoints.openai.errors import bad_request
from mm_serve.entrypoints.openai.protocol import SamplingRequest
from mm_serve.messages.structured_outputs import StructuredOutputsParams, check_grammar


def output_constraints(
    request: SamplingRequest, tool_constraint: StructuredOutputsParams | None = None
) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments for the request's ``logit_bias`` and structured
    output (``response_format``, ``structured_outputs``, or ``tool_constraint``: the chat's
    ``tool_choice`` ``required`` or named function); empty when it sets none.

    Raises:
        APIError: (400) naming the field: a token id that is not an integer, both fields
            set, not exactly one ``structured_outputs`` kind, or a schema, regex or grammar
            that does not compile (the compiler's message).
    """
    kwargs: dict[str, Any] = {}
    if request.logit_bias:  # its ids' range: frontend.processor.check_sampling_params
        kwargs["logit_bias"] = _logit_bias(request.logit_bias)
    params, field = _structured_outputs(request)
    if tool_constraint is not None:
        if params is not None:
            message = f"{field} cannot be used with tool_choice 'required' or a named function."
            raise bad_request(message, param=field)
        params, field = tool_constraint, "tools"
    if params is not None:
        try:
            check_grammar(params)
        except ValueError as e:
            raise bad_request(str(e), param=field) from None
        kwargs["structured_outputs"] = params
    return kwargs


def _logit_bias(logit_bias: dict[str, float]) -> dict[int, float]:
    """``logit_bias`` by int token id; raises APIError (400) naming every key that is not
    one (their range: ``frontend.processor.check_sampling_params``)."""
    ids, bad = {}, []
    for token, bias in logit_bias.items():
        try:
            ids[int(token)] = bias
        except ValueError:
            bad.append(token)
    if bad:
        message = f"logit_bias keys must be token ids (integers); got {', '.join(map(repr, bad))}."
        raise bad_request(message, param="logit_bias")
    return ids


def _structured_outputs(request: SamplingRequest) -> tuple[StructuredOutputsParams | None, str]:
    """The request's constraint and the field that set it."""
    response_format, fields = request.response_format, request.structured_outputs
    if response_format is not None and response_format.type != "text":
        if fields is not None:
            message = "Set response_format or structured_outputs, not both."
            raise bad_request(message, param="structured_outputs")
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        schema = response_format.json_schema and response_format.json_schema.json_schema
        if schema is None:
            message = "response_format json_schema needs json_schema.schema."
            raise bad_request(message, param="response_format")
        return StructuredOutputsParams(json=json.dumps(schema)), "response_format"
    if fields is None:
        return None, ""
    schema = fields.json_
    try:
        return StructuredOutputsParams(
            json=schema if schema is None or isinstance(schema, str) else json.dumps(schema),
            regex=fields.regex,
            choice=fields.choice,
            grammar=fields.grammar,
            json_object=bool(fields.json_object),
        ), "structured_outputs"
    except ValueError as e:
        raise bad_request(str(e), param="structured_outputs") from None
