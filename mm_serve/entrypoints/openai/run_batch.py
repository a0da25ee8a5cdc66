"""``mm-serve run-batch -i FILE -o FILE``: a file of OpenAI batch requests, answered offline
(vLLM's ``vllm run-batch``).

Input: one request per line in OpenAI's batch format, ``{"custom_id", "method": "POST", "url",
"body"}``, ``url`` one of ``URLS`` (``/v1/embeddings`` with ``--runner pooling``, the others
without). Output: one line per input line, in input order, as OpenAI's batch output: ``{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}``; ``error`` is null
when the status is 200, else ``{"code", "message"}`` beside the error body the server would
have answered. A line that is not a batch request (not JSON, a field missing, a streamed
request) gets its error line and the others go on.

Each line goes through the server's own handlers (``ServingChat``, ``ServingCompletion``,
``ServingEmbedding``) without HTTP, the engine core in its own process as under ``mm-serve
serve``: a line's response body is what the server answers to the same body, ids and
timestamps aside. At most ``max_concurrent_requests`` lines are in the engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import time
import uuid
from typing import Any, Literal

from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel, ValidationError
from tqdm.auto import tqdm

from mm_serve.config import EngineArgs
from mm_serve.entrypoints.openai.api_server import ServerConfig, serving_handlers
from mm_serve.entrypoints.openai.errors import APIError, bad_request, to_api_error
from mm_serve.entrypoints.openai.errors import validation_error as schema_error
from mm_serve.entrypoints.openai.media import MediaResolver
from mm_serve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from mm_serve.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from mm_serve.entrypoints.openai.serving_common import ServingBase
from mm_serve.entrypoints.openai.serving_embeddings import ServingEmbedding
from mm_serve.frontend.async_llm import AsyncLLM

URLS = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}
Handler = ServingBase | ServingEmbedding


class BatchRequest(BaseModel):
    """One input line."""

    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


def output_line(custom_id: str | None, result: BaseModel | APIError) -> dict[str, Any]:
    """The output line of a request: its response body, or the error's."""
    ok = not isinstance(result, APIError)
    body = jsonable_encoder(result) if ok else result.body()
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200 if ok else result.status,
            "request_id": body.get("id") if ok else None,
            "body": body,
        },
        "error": None if ok else {"code": result.code, "message": result.message},
    }


def _custom_id(line: str) -> str | None:
    """The ``custom_id`` of a line that failed validation, when it has a string one."""
    with contextlib.suppress(ValueError):
        value = json.loads(line)
        if isinstance(value, dict) and isinstance(value.get("custom_id"), str):
            return value["custom_id"]
    return None


async def answer(line: str, handlers: dict[str, Handler]) -> dict[str, Any]:
    """The output line of one input line (errors included: never raises)."""
    try:
        item = BatchRequest.model_validate_json(line)
    except ValidationError as e:
        return output_line(_custom_id(line), schema_error(e.errors()))
    try:
        if item.url not in URLS:
            raise bad_request(
                f"url {item.url!r} is not served in a batch; use one of {sorted(URLS)}.", "url"
            )
        request = URLS[item.url].model_validate(item.body)
        if getattr(request, "stream", False):  # (embeddings have no stream)
            raise bad_request("A batch request cannot be streamed.", "body.stream")
        return output_line(
            item.custom_id, await handlers[item.url].handle(request, time.monotonic())
        )
    except ValidationError as e:
        return output_line(item.custom_id, schema_error(e.errors()))
    except Exception as e:  # the server's error answer, as its error handlers give it
        return output_line(item.custom_id, to_api_error(e))


async def answer_all(
    lines: list[str], handlers: dict[str, Handler], max_in_flight: int
) -> list[dict[str, Any]]:
    """The output lines of ``lines`` in their order, at most ``max_in_flight`` lines at once in
    the engine, with a progress bar."""
    gate = asyncio.Semaphore(max_in_flight)
    progress = tqdm(total=len(lines), desc="Batch requests", unit="req")

    async def one(line: str) -> dict[str, Any]:
        async with gate:
            result = await answer(line, handlers)
        progress.update()
        return result

    try:
        return await asyncio.gather(*(one(line) for line in lines))
    finally:
        progress.close()


def read_lines(path: str) -> list[str]:
    """The non-blank lines of ``path`` (``-``: standard input)."""
    with contextlib.nullcontext(sys.stdin) if path == "-" else open(path) as f:
        return [line for line in f if line.strip()]


def write_lines(path: str, outputs: list[dict[str, Any]]) -> None:
    """One JSON object per line to ``path`` (``-``: standard output)."""
    with contextlib.nullcontext(sys.stdout) if path == "-" else open(path, "w") as stream:
        for output in outputs:
            stream.write(json.dumps(output, ensure_ascii=False) + "\n")


async def run_batch(
    engine_args: EngineArgs, config: ServerConfig, input_path: str, output_path: str
) -> int:
    """Answer ``input_path``'s lines into ``output_path`` with ``config``'s model names, media
    and limits (``max_concurrent_requests``: lines at once); returns how many lines got an
    error.

    Raises:
        ValueError: an unusable checkpoint or option. OSError: unreadable input, unwritable
            output.
    """
    lines = read_lines(input_path)
    llm = await AsyncLLM.create(engine_args)
    media = MediaResolver(config.media)
    try:
        # Lines wait at the gate instead of getting a 429; n stays capped at max_n.
        unlimited = dataclasses.replace(config, max_concurrent_requests=sys.maxsize)
        served = serving_handlers(llm, unlimited, media)
        handlers = dict(zip(URLS, (served.chat, served.completion, served.embedding), strict=True))
        outputs = await answer_all(lines, handlers, config.max_concurrent_requests)
    finally:
        await media.aclose()
        llm.shutdown()
    write_lines(output_path, outputs)
    return sum(output["error"] is not None for output in outputs)
