"""``POST /v1/completions``: text (or token-id) prompts in, completions (or SSE chunks) out.

A batch of prompts gives ``len(prompts) * n`` choices; choice ``i * n + j`` is completion
``j`` of prompt ``i``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mm_serve.entrypoints.openai import serving_common
from mm_serve.entrypoints.openai.errors import bad_request, user_errors
from mm_serve.entrypoints.openai.logprobs import (
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_field,
)
from mm_serve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from mm_serve.frontend.processor import ProcessedPrompt
from mm_serve.messages.outputs import CompletionOutput, RequestOutput


@dataclass
class _Reply(serving_common.Reply):
    n: int = 1
    # choice index -> text offset of its next token (for logprobs.text_offset)
    offsets: dict[int, int] = field(default_factory=dict)
    echo_texts: list[str] | None = None  # echo: each prompt's text, before its completions
    show_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field asked for

    def choice(
        self, prompt_index: int, output: CompletionOutput, prompt: RequestOutput | None
    ) -> CompletionChoice:
        """Choice ``prompt_index * n + output.index``, with ``prompt``'s token ids (when asked:
        ``return_token_ids``), prompt logprobs and echoed text when given: in a stream, in the
        choice's first chunk only."""
        index = prompt_index * self.n + output.index
        echo = self.echo_texts[prompt_index] if self.echo_texts and prompt else ""
        logprobs = None
        if self.num_top_logprobs is not None:
            logprobs = self._logprobs(index, output, prompt if echo else None, echo)
        return CompletionChoice(
            index=index,
            text=echo + output.text,
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            token_ids=self.token_ids(output.token_ids),
            prompt_token_ids=self.token_ids(prompt.prompt_token_ids) if prompt else None,
            prompt_logprobs=prompt_logprobs_field(prompt.prompt_logprobs)
            if prompt and self.show_prompt_logprobs
            else None,
        )

    def _logprobs(
        self, index: int, output: CompletionOutput, echoed: RequestOutput | None, echo: str
    ) -> CompletionLogprobs:
        """The choice's ``logprobs``: an ``echoed`` prompt's (``echo_logprobs``), then its
        tokens'."""
        num_top, as_ids = self.num_top_logprobs, self.tokens_as_ids
        offset, prefix = self.offsets.get(index, 0), None
        if echoed is not None:
            ids, steps = echoed.prompt_token_ids, echoed.prompt_logprobs
            prefix, offset = echo_logprobs(ids, steps, echo, num_top, as_ids)
        logprobs, self.offsets[index] = completion_logprobs(
            output.token_ids, output.logprobs, num_top, as_ids, offset, prefix
        )
        return logprobs


class ServingCompletion(serving_common.ServingBase):
    """Text completions of one prompt or a batch (no images: use chat completions)."""

    async def create(
        self, request: CompletionRequest, arrival_time: float
    ) -> CompletionResponse | AsyncIterator[str]:
        model = self.model.name_for(request.model)
        usage = serving_common.stream_usage(request)
        if request.echo and request.logprobs is not None and request.stream:
            raise bad_request("echo with logprobs cannot be streamed.", param="echo")
        if request.suffix:
            raise bad_request("suffix is not supported.", param="suffix")
        params = self.sampling_params(request, request.max_tokens, request.logprobs)
        if request.echo and request.logprobs is not None:  # the prompt's logprobs too
            num = max(request.logprobs, params.prompt_logprobs or 0)
            params = dataclasses.replace(params, prompt_logprobs=num)
        processed = []
        with user_errors():
            for prompt in serving_common.prompt_dicts(
                request.prompt, "prompt", self.llm.config.model.vocab_size
            ):
                if request.cache_salt is not None:
                    prompt["cache_salt"] = request.cache_salt
                processed.append(await self.llm.process(prompt, request.add_special_tokens))
        base_id = f"cmpl-{uuid.uuid4().hex}"
        streams = [
            self.generate(
                request, p, self.fit_to_context(params, p), f"{base_id}-{i}", arrival_time
            )
            for i, p in enumerate(processed)
        ]
        reply = _Reply(
            base_id,
            model,
            request.logprobs,
            request.return_tokens_as_token_ids,
            params.n,
            return_token_ids=request.return_token_ids,
            show_prompt_logprobs=request.prompt_logprobs is not None,
        )
        if request.echo:
            reply.echo_texts = [await self._prompt_text(p) for p in processed]
        if request.stream:
            return _stream(streams, reply, usage)
        with user_errors():
            outputs = await serving_common.gather_or_cancel(map(serving_common.collect, streams))
            return _response(outputs, reply)

    async def _prompt_text(self, prompt: ProcessedPrompt) -> str:
        """The prompt as ``echo`` repeats it: its text, or its token ids decoded."""
        if prompt.text is not None:
            return prompt.text
        token_ids = prompt.token_ids
        return await self.llm.with_tokenizer(lambda tokenizer: tokenizer.decode(token_ids))


def _response(outputs: list[RequestOutput], reply: _Reply) -> CompletionResponse:
    choices = [
        reply.choice(i, c, output) for i, output in enumerate(outputs) for c in output.outputs
    ]
    num_completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    usage = serving_common.usage_info(outputs, num_completion)
    return reply.response(CompletionResponse, choices, usage)


async def _stream(
    streams: list[AsyncIterator[RequestOutput]], reply: _Reply, usage: serving_common.StreamUsage
) -> AsyncIterator[str]:
    """One chunk per choice and token (text empty for a token without text of its own), in
    the order the prompts' outputs arrive; the last token's chunk has the finish reason.
    ``usage``: a last chunk of the usage, and the usage so far (of the prompts begun) in each."""
    last: dict[int, RequestOutput] = {}
    started: set[tuple[int, int]] = set()  # (prompt, completion) pairs with a chunk sent
    num_completion = 0
    async with contextlib.aclosing(_merge(streams)) as merged:
        async for prompt_index, output in merged:
            last[prompt_index] = output
            for delta in output.outputs:
                for piece in serving_common.per_token(delta):
                    num_completion += len(piece.token_ids)
                    first = (prompt_index, piece.index) not in started
                    started.add((prompt_index, piece.index))
                    choice = reply.choice(prompt_index, piece, output if first else None)
                    so_far = usage.so_far(list(last.values()), num_completion)
                    yield reply.event(CompletionResponse, [choice], so_far)
    if usage.final:
        so_far = serving_common.usage_info(list(last.values()), num_completion)
        yield reply.event(CompletionResponse, [], so_far)


async def _merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, item) of several streams as they come; the first error is raised and
    the other streams are cancelled."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((index, item))
            queue.put_nowait((index, None))
        except Exception as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
