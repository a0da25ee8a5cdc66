"""What chat and text completions share: model check, admission, sampling parameters,
context-length fitting, usage, and the SSE response (logprobs: ``logprobs.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mm_serve.entrypoints.openai.constraints import output_constraints
from mm_serve.entrypoints.openai.errors import (
    APIError,
    bad_request,
    engine_dead_error,
    to_api_error,
    user_errors,
)
from mm_serve.entrypoints.openai.protocol import (
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
)
from mm_serve.frontend.async_llm import AsyncLLM
from mm_serve.frontend.processor import ProcessedPrompt, check_sampling_params
from mm_serve.lora.request import LoRARequest
from mm_serve.messages.outputs import CompletionOutput, RequestOutput
from mm_serve.messages.sampling_params import BeamSearchParams, SamplingParams
from mm_serve.messages.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2] (SamplingParams, offline, takes any >= 0)

# Request fields passed to SamplingParams as they are, when set.
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "prompt_logprobs",
)  # fmt: skip


@dataclass(frozen=True)
class ModelInfo:
    """The served model: its names (the first is reported), the checkpoint as given, and the
    LoRA adapters served beside it by name (``serving_models.ServingModels`` adds and removes
    them; a request names one in ``model``)."""

    names: tuple[str, ...]
    root: str
    loras: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)

    def name_for(self, requested: str | None) -> str:
        """The name to report: the base model's or an adapter's; raises APIError (404) for a
        model this server does not serve."""
        if requested is None:
            return self.names[0]
        if requested not in self.names and requested not in self.loras:
            served = [*self.names, *self.loras]
            raise APIError(
                404,
                f"The model {requested!r} does not exist; this server serves {served}.",
                "model_not_found",
                "model",
            )
        return requested

    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The adapter that ``model`` names; None for the base model."""
        return None if requested is None else self.loras.get(requested)


class Admission:
    """Caps the sequences in flight (a request's ``n`` completions or beams count ``n``):
    beyond ``limit``, a 429; and one request's ``n`` at ``max_n`` (OpenAI's bound is 128), so
    that no single request holds the engine for everyone."""

    def __init__(self, limit: int, max_n: int = 128) -> None:
        self.limit, self.max_n = limit, max_n
        self.in_flight = 0

    def enter(self, n: int = 1) -> None:
        """Admit a request of ``n`` sequences.

        Raises:
            APIError: 400 when ``n`` is above ``max_n``; 429 when the sequences in flight
                would pass ``limit`` (a request alone on the server is always admitted).
        """
        if n > self.max_n:
            message = f"n must be at most {self.max_n} (the server's --max-n), got {n}."
            raise bad_request(message, param="n")
        if self.in_flight and self.in_flight + n > self.limit:
            raise APIError(
                429,
                f"The server has {self.in_flight} sequences in flight, near its limit of "
                f"{self.limit}; retry later.",
                "server_overloaded",
                headers={"Retry-After": "1"},
            )
        self.in_flight += n

    def leave(self, n: int = 1) -> None:
        """``n`` sequences in flight less (after each ``enter(n)`` that did not raise)."""
        self.in_flight -= n


class EventStreamResponse(StreamingResponse):
    """Server-sent events; ``on_close`` runs once the stream is over, however it ended
    (finished, failed, cut by the client or never started), after the iterator is closed."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._on_close()


def sse_event(data: BaseModel | dict) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"
R = TypeVar("R", bound=BaseModel)
T = TypeVar("T")


@dataclass
class Reply:
    """What one request's response (or each of its chunks) needs besides the outputs."""

    request_id: str
    model: str
    num_top_logprobs: int | None  # None: no logprobs
    tokens_as_ids: bool
    created: int = dataclasses.field(default_factory=lambda: int(time.time()), kw_only=True)
    return_token_ids: bool = dataclasses.field(default=False, kw_only=True)

    def response(
        self, cls: type[R], choices: list, usage: UsageInfo | None = None, **fields: Any
    ) -> R:
        """A ``cls`` (a response or chunk model) of ``choices`` with this reply's header (and
        ``fields``)."""
        header = {"id": self.request_id, "created": self.created, "model": self.model}
        return cls(**header, choices=choices, usage=usage, **fields)

    def event(
        self, cls: type[BaseModel], choices: list, usage: UsageInfo | None = None, **fields: Any
    ) -> str:
        """``response(...)`` as one server-sent event (a stream's chunk)."""
        return sse_event(self.response(cls, choices, usage, **fields))

    def token_ids(self, token_ids: list[int]) -> list[int] | None:
        """``token_ids`` when the request asked for them (``return_token_ids``), else None."""
        return list(token_ids) if self.return_token_ids else None


class ServingBase:
    """Shared by ``ServingChat`` and ``ServingCompletion``; ``handle`` runs one request."""

    def __init__(self, llm: AsyncLLM, model: ModelInfo, admission: Admission) -> None:
        self.llm = llm
        self.model = model
        self.admission = admission

    async def handle(self, request: SamplingRequest, arrival_time: float):
        """Run ``create`` within the admission limit: a response model, or an
        ``EventStreamResponse`` when ``create`` returns a stream of SSE strings (an error
        midway and the closing ``data: [DONE]`` added by ``stream_with_errors``).

        Raises:
            APIError: the request's error (see ``errors``).
        """
        if self.llm.is_dead:
            raise engine_dead_error()
        check_request_fields(request)
        check_runner(self.llm, pooling=False)
        leave = functools.partial(self.admission.leave, request.n)
        self.admission.enter(request.n)
        try:
            result = await self.create(request, arrival_time)
        except BaseException:
            leave()
            raise
        if isinstance(result, BaseModel):
            leave()
            return result
        return EventStreamResponse(stream_with_errors(result), on_close=leave)

    async def create(self, request: Any, arrival_time: float) -> BaseModel | AsyncIterator[str]:
        """The response model, or (``stream``) the SSE events of the streamed response (each
        subclass its endpoint's).

        Raises:
            APIError: see ``errors``.
        """
        raise NotImplementedError

    def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        tool_constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's ``SamplingParams``: its fields, else the checkpoint's
        generation_config defaults, else vLLM's. ``max_tokens`` None: up to the context.
        ``tool_constraint``: the chat's tool call that the output must be
        (``tool_calls.ToolMode.constraint``).

        Raises:
            APIError: (400) a value out of range, naming the field.
        """
        if request.use_beam_search:
            check_beam_search(request)
        if request.prompt_logprobs is not None:
            if request.stream:
                raise bad_request("prompt_logprobs cannot be streamed.", param="prompt_logprobs")
            if not 0 <= request.prompt_logprobs <= MAX_LOGPROBS:
                message = f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]."
                raise bad_request(message, param="prompt_logprobs")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            name = "top_logprobs" if hasattr(request, "top_logprobs") else "logprobs"  # chat's
            raise bad_request(f"{name} must be in [0, {MAX_LOGPROBS}].", param=name)
        temperature = request.temperature
        if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
            message = f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}."
            raise bad_request(message, param="temperature")
        self._check_engine_limits(request)
        kwargs = self.llm.default_sampling_overrides()
        kwargs |= {f: v for f in _SAMPLING_FIELDS if (v := getattr(request, f)) is not None}
        kwargs |= output_constraints(request, tool_constraint)
        with user_errors():
            params = SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs)
            check_sampling_params(params, self.llm.config.model.vocab_size)
        return params

    def generate(
        self,
        request: SamplingRequest,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        request_id: str,
        arrival_time: float,
    ) -> AsyncIterator[RequestOutput]:
        """``AsyncLLM.generate``, or with ``use_beam_search`` its beam search (``params.n``
        beams, ``max_tokens`` rounds), which yields the finished output only (as vLLM's server
        does; a stream sends it as one chunk per choice and token at the end); with the LoRA
        adapter that ``request.model`` names, if it names one."""
        lora_request = self.model.lora_request(request.model)
        if not request.use_beam_search:
            return self.llm.generate(
                prompt,
                params,
                request_id,
                arrival_time,
                priority=request.priority,
                lora_request=lora_request,
            )
        beam_params = beam_search_params(request, params)
        num_logprobs = params.logprobs or 0
        return self.llm.beam_search(prompt, beam_params, request_id, num_logprobs, lora_request)

    def _check_engine_limits(self, request: SamplingRequest) -> None:
        """What ``SamplingParams`` lets through but the engine cannot take: stop token ids
        outside the vocabulary, seeds beyond 64 bits (each of the ``n`` uses ``seed + i``).

        Raises:
            APIError: (400) naming the field.
        """
        vocab_size = self.llm.config.model.vocab_size
        if any(not 0 <= t < vocab_size for t in request.stop_token_ids or ()):
            raise bad_request(
                f"stop_token_ids must be in [0, {vocab_size}).", param="stop_token_ids"
            )
        seed, n = request.seed, request.n
        if seed is not None and not -(2**63) <= seed <= 2**63 - 1 - max(n, 1):
            raise bad_request("seed must be a signed 64-bit integer.", param="seed")
        if request.priority and self.llm.config.scheduler.scheduling_policy != "priority":
            raise bad_request(
                "priority needs the server started with --scheduling-policy priority.",
                param="priority",
            )

    def fit_to_context(self, params: SamplingParams, prompt: ProcessedPrompt) -> SamplingParams:
        """``params`` with ``max_tokens`` set to the room left in the context when unset.

        Raises:
            APIError: (400, ``context_length_exceeded``) prompt + ``max_tokens`` exceed
                ``max_model_len``.
        """
        max_len, num_prompt = self.llm.max_model_len, len(prompt.token_ids)
        room = max_len - num_prompt
        if params.max_tokens is not None and params.max_tokens > room:
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens, but "
                f"{num_prompt + params.max_tokens} were requested ({num_prompt} in the prompt, "
                f"{params.max_tokens} for the completion). Shorten the prompt or lower "
                "max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if params.max_tokens is not None:
            return params
        with user_errors():
            return dataclasses.replace(params, max_tokens=room)


def check_runner(llm: AsyncLLM, pooling: bool) -> None:
    """Raises APIError (400) naming ``model`` when the served model does not run this kind of
    request: embeddings under the pooling runner only, generation under the others."""
    try:
        llm.check_runner(pooling)
    except ValueError as e:
        raise bad_request(str(e), param="model") from None


def prompt_dicts(
    value: str | list[str] | list[int] | list[list[int]], param: str, vocab_size: int
) -> list[dict]:
    """OpenAI's ``prompt`` (completions) or ``input`` (embeddings): a text, texts, token ids or
    lists of token ids, as prompt dicts, one per prompt.

    Raises:
        APIError: (400) naming ``param``: an empty list, or a token id outside
            ``[0, vocab_size)``.
    """
    if isinstance(value, str):
        return [{"prompt": value}]
    if not value:
        raise bad_request(f"{param} must not be empty.", param=param)
    if isinstance(value[0], int):
        value = [value]
    key = "prompt" if isinstance(value[0], str) else "prompt_token_ids"
    for ids in value if key == "prompt_token_ids" else ():
        if bad := [t for t in ids if not 0 <= t < vocab_size]:
            message = (
                f"{param} token ids {bad} are out of vocabulary (vocabulary size {vocab_size})."
            )
            raise bad_request(message, param=param)
    return [{key: p} for p in value]


async def gather_or_cancel(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every result, in order; on the first error the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


@dataclass(frozen=True)
class StreamUsage:
    """The usage a stream reports: a last chunk with it and no choices (``final``, OpenAI's
    ``include_usage``), and in every chunk the usage so far (``continuous``, vLLM's
    ``continuous_usage_stats``, only beside ``include_usage`` as vLLM has it)."""

    final: bool = False
    continuous: bool = False

    def so_far(self, outputs: list[RequestOutput], num_completion: int) -> UsageInfo | None:
        """A chunk's usage: ``usage_info`` when ``continuous``, else None."""
        return usage_info(outputs, num_completion) if self.continuous and outputs else None


def stream_usage(request: SamplingRequest) -> StreamUsage:
    """The request's ``stream_options`` usage settings (null is false).

    Raises:
        APIError: (400) ``stream_options`` in a request that does not stream.
    """
    options = request.stream_options
    if options is not None and not request.stream:
        raise bad_request(
            "stream_options can only be set when stream is true.", param="stream_options"
        )
    final = bool(options and options.include_usage)
    return StreamUsage(final, final and bool(options.continuous_usage_stats))


def per_token(delta: CompletionOutput) -> list[CompletionOutput]:
    """A completion's delta as one delta per token, in order, each with its logprobs, so that
    a stream sends a chunk per token as OpenAI clients count them (vLLM's ``bench serve``
    among them), also for tokens without text.

    The delta's text and finish reason ride on its last token: the text is released as a
    whole (a character may span tokens; text that may begin a stop string waits) and it
    ends with that token. A delta without tokens is returned as it is.
    """
    if len(delta.token_ids) <= 1:
        return [delta]
    last = len(delta.token_ids) - 1
    return [
        dataclasses.replace(
            delta,
            text=delta.text if i == last else "",
            token_ids=[token_id],
            logprobs=None if delta.logprobs is None else delta.logprobs[i : i + 1],
            finish_reason=delta.finish_reason if i == last else None,
            stop_reason=delta.stop_reason if i == last else None,
        )
        for i, token_id in enumerate(delta.token_ids)
    ]


def usage_info(outputs: list[RequestOutput], num_completion: int) -> UsageInfo:
    """The usage of a reply of ``num_completion`` tokens to ``outputs``' prompts (one per
    prompt), with the prompt tokens served by the prefix cache and the images not encoded for
    the request."""
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    details = PromptTokensDetails(
        cached_tokens=sum(o.num_cached_tokens for o in outputs),
        cached_images=sum(o.num_cached_images for o in outputs),
    )
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=details,
    )


async def stream_with_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """SSE strings of ``events``, then ``data: [DONE]``; an error midway becomes one
    ``data: {"error": ...}`` event before it (the status line was sent already)."""
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
        except Exception as e:
            yield sse_event(to_api_error(e).body())
    yield SSE_DONE


async def collect(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The whole request from the deltas of ``AsyncLLM.generate``, completions in order."""
    merged: dict[int, CompletionOutput] = {}
    last = prompt_logprobs = None
    async with contextlib.aclosing(outputs):
        async for last in outputs:
            prompt_logprobs = prompt_logprobs or last.prompt_logprobs
            for delta in last.outputs:
                whole = merged.get(delta.index)
                if whole is None:
                    merged[delta.index] = dataclasses.replace(
                        delta,
                        token_ids=list(delta.token_ids),
                        logprobs=None if delta.logprobs is None else list(delta.logprobs),
                    )
                    continue
                whole.text += delta.text
                whole.token_ids += delta.token_ids
                if whole.logprobs is not None:
                    whole.logprobs += delta.logprobs
                whole.cumulative_logprob = delta.cumulative_logprob
                whole.finish_reason, whole.stop_reason = delta.finish_reason, delta.stop_reason
    assert last is not None, "generate() yields at least the finish of every completion"
    outputs_in_order = [merged[i] for i in sorted(merged)]
    return dataclasses.replace(last, outputs=outputs_in_order, prompt_logprobs=prompt_logprobs)


def check_request_fields(request: BaseModel) -> None:
    """Refuse an unsupported field (``check_undeclared_fields``) or a text that is not valid
    Unicode (``reject_invalid_text``), before anything reads the request.

    Raises:
        APIError: (400) naming the field.
    """
    check_undeclared_fields(request)
    reject_invalid_text(request)


def reject_invalid_text(value: Any, param: str = "") -> None:
    """Refuse the first string in ``value`` (a request model, or a list, dict or string it
    holds) that is not valid Unicode: an unpaired surrogate, which JSON can spell
    (``"\\ud800"``) but no tokenizer or image decoder takes.

    Raises:
        APIError: (400) naming the field (``messages[0].content``).
    """
    if isinstance(value, str):
        if not value.isascii() and not _encodes(value):
            where = param or "the body"
            raise bad_request(f"{where} is not valid Unicode (an unpaired surrogate).", param)
    elif isinstance(value, BaseModel):
        for name in (*type(value).model_fields, *(value.model_extra or {})):
            reject_invalid_text(getattr(value, name), f"{param}.{name}" if param else name)
    elif isinstance(value, dict):
        for key, item in value.items():
            reject_invalid_text(key, param)
            reject_invalid_text(item, f"{param}.{key}" if param else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            reject_invalid_text(item, f"{param}[{index}]")


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_undeclared_fields(request: BaseModel) -> None:
    """Refuse a field that OpenAI or vLLM defines and this server does not implement (an
    object's ``unsupported_fields``: ``protocol.UNSUPPORTED_FIELDS`` at the top level, e.g.
    ``audio`` in a chat message, ``continuous_usage_stats`` in ``stream_options``); accept a
    field neither defines, logging its name once, as vLLM does. Undeclared fields are looked
    for in every object of the request (messages, content parts and their ``image_url``,
    tools, ``response_format``, ...). A null value asks for nothing and passes (an SDK's dump
    of an earlier reply), except an unsupported top-level field.

    Raises:
        APIError: (400) naming the unsupported field (``messages[0].audio``).
    """
    for param, value, unsupported in _undeclared_fields(request):
        if unsupported:
            raise bad_request(f"Unsupported field {param!r}.", param=param)
        if value is not None:
            _log_ignored_once(re.sub(r"\[\d+\]", "[]", param))


def _undeclared_fields(value: Any, prefix: str = "") -> Iterator[tuple[str, Any, bool]]:
    """``(param, value, unsupported)`` of each undeclared field of ``value`` (a request
    model, or a list or dict it holds) and of the objects within, depth first."""
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _undeclared_fields(item, f"{prefix}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _undeclared_fields(item, f"{prefix}.{key}" if prefix else str(key))
        return
    if not isinstance(value, BaseModel):
        return
    unsupported_fields = getattr(value, "unsupported_fields", frozenset())
    for name, extra in sorted((value.model_extra or {}).items()):
        unsupported = name in unsupported_fields and (extra is not None or not prefix)
        yield f"{prefix}.{name}" if prefix else name, extra, unsupported
    for name in type(value).model_fields:
        yield from _undeclared_fields(getattr(value, name), f"{prefix}.{name}" if prefix else name)


_logged_fields: set[str] = set()


def _log_ignored_once(field: str) -> None:
    if field not in _logged_fields:
        _logged_fields.add(field)
        logger.warning("Ignoring the field %r: neither OpenAI's API nor vLLM's defines it.", field)


# Fields beam search cannot honour, with the values that change nothing: another is a 400.
_NOT_WITH_BEAM_SEARCH = {
    "stop": (None, []), "stop_token_ids": (None, []), "min_tokens": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "top_p": (None, 1), "top_k": (None, 0, -1), "min_p": (None, 0), "prompt_logprobs": (None,),
    "logit_bias": (None, {}), "response_format": (None,), "structured_outputs": (None,),
}  # fmt: skip


def check_beam_search(request: SamplingRequest) -> None:
    """Raises APIError (400) naming a field set to a value beam search cannot honour (stop
    strings or tokens, penalties, truncated sampling, prompt logprobs, logit bias, a
    structured output)."""
    for name, neutral in _NOT_WITH_BEAM_SEARCH.items():
        if getattr(request, name) not in neutral:
            raise bad_request(f"{name} cannot be used with use_beam_search.", param=name)


def beam_search_params(request: SamplingRequest, params: SamplingParams) -> BeamSearchParams:
    """``n`` beams, ``max_tokens`` rounds, ``ignore_eos``, ``temperature`` and the request's
    ``length_penalty`` (vLLM's ``to_beam_search_params``).

    Raises:
        APIError: (400) a value out of range.
    """
    with user_errors():
        return BeamSearchParams(
            beam_width=params.n,
            max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos,
            temperature=params.temperature,
            length_penalty=request.length_penalty,
        )
