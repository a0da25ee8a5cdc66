"""Online serving benchmark: a load generator for an OpenAI-compatible server.

Sends ``--num-prompts`` synthetic image+text chats (``datasets.random_image_dataset``) to
``POST /v1/chat/completions`` with streaming, and reports TTFT, TPOT, ITL and e2e latency
(ms), and request and token throughput, like ``vllm bench serve``. Requests arrive all at
once (``--request-rate inf``) or as a Poisson process (``--request-rate`` req/s; with
``--burstiness`` the gaps are gamma-distributed), and ``--max-concurrency`` caps how many are
in flight. All request bodies (images as PNG data URLs) are encoded before the clock starts.

    python -m mm_serve.benchmarks.serve --num-prompts 100 --request-rate 4 --ignore-eos \\
        --output-json result.json --plot latencies.png

Only httpx, numpy and PIL are needed (matplotlib for ``--plot``), so it runs on a GPU host
without the server's web stack. Statistics and the plot live in ``serve_metrics.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from mm_serve.benchmarks.datasets import openai_messages, random_image_dataset
from mm_serve.benchmarks.serve_metrics import (
    RequestResult,
    format_table,
    parse_percentiles,
    plot_latencies,
    summarize,
)

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"


class BenchmarkError(RuntimeError):
    """The benchmark cannot start (server unreachable, no model to pick, bad arguments)."""


@dataclass(frozen=True)
class LoadConfig:
    """How requests are sent: where, with which headers, when (arrivals) and how many at once.

    ``request_rate`` is in requests/s (``inf``: all at once); ``timeout_s`` bounds each
    request's whole exchange in seconds.
    """

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 6 * 3600.0


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times in s after the start, non-decreasing, the first at 0.

    ``request_rate`` inf sends all at 0. Otherwise the gaps are gamma-distributed with shape
    ``burstiness`` and mean ``1 / request_rate`` (vLLM's ``--burstiness``): shape 1 is the
    exponential, i.e. a Poisson process; below 1 is burstier, above 1 more regular.

    Raises:
        ValueError: ``request_rate`` or ``burstiness`` is not positive.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0: {request_rate}, {burstiness}")
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line, or None for blank lines, comments and other
    fields (``event:``, ``id:``)."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def error_message(body: str) -> str:
    """The ``message`` of an OpenAI-style ``{"error": {"message"}}`` body, or the start of
    any other body."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)[:300]
    return str(error)[:300]


def error_text(status: int, body: str) -> str:
    """``"HTTP 404: <message>"`` for a failed response's status and body."""
    return f"HTTP {status}: {error_message(body)}"


def _finish(result: RequestResult, start: float, chunk_times: list[float], end: float) -> None:
    """Fill TTFT, ITL and e2e (s) of a stream whose content chunks arrived at
    ``chunk_times`` (``time.perf_counter`` s)."""
    if not chunk_times:
        result.error = "The stream ended without any content chunk."
        return
    result.ttft_s = chunk_times[0] - start
    result.itl_s = np.diff(chunk_times).tolist()
    result.e2e_s = end - start
    if result.output_tokens == 0:  # no usage chunk: count chunks, the best we know
        result.output_tokens = len(chunk_times)
    result.success = True


def is_token_chunk(event: dict) -> bool:
    """True for a streamed chat chunk that carries a token (see ``send_request``)."""
    choices = event.get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    content = delta.get("content")
    return bool(content) or (content == "" and "role" not in delta)


async def send_request(
    client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str]
) -> RequestResult:
    """POST one streamed chat request and time its chunks; never raises for a failed request
    (HTTP error, connection error, error event, cut stream): ``error`` says what happened.

    A token chunk is counted by vLLM's ``bench serve`` rule: its delta has non-empty
    ``content``, or ``content == ""`` and no ``role`` (a token without text of its own; the
    role chunk that opens a choice is not a token).
    """
    result = RequestResult()
    chunk_times: list[float] = []
    finished = False
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, content=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = error_text(response.status_code, text)
                return result
            async for line in response.aiter_lines():
                data = sse_data(line)
                if data == "[DONE]":
                    finished = True
                    break
                if not data:
                    continue
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    result.error = f"Error event: {error_message(data)}"
                    return result
                if is_token_chunk(event):
                    chunk_times.append(now)
                if usage := event.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens") or 0
                    result.output_tokens = usage.get("completion_tokens") or 0
    except (httpx.HTTPError, httpx.StreamError, ValueError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if not finished:
        result.error = "The stream ended before data: [DONE]."
        return result
    _finish(result, start, chunk_times, time.perf_counter())
    return result


async def run_load(bodies: list[bytes], config: LoadConfig) -> tuple[list[RequestResult], float]:
    """Send ``bodies`` (encoded JSON) on the arrival schedule; returns the results in the
    order of ``bodies`` and the duration in s from the first send to the last response.

    A request's clock starts when it is sent, after waiting for a ``max_concurrency`` slot;
    its ``start_s`` is that moment, in s after the run's start.
    """
    offsets = arrival_times(len(bodies), config.request_rate, config.burstiness, config.seed)
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(body: bytes) -> RequestResult:
            async with slots or contextlib.nullcontext():
                sent_s = time.perf_counter() - start
                result = await send_request(client, config.url, body, config.headers)
            result.start_s = sent_s
            return result

        start = time.perf_counter()
        tasks = []
        for body, offset in zip(bodies, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(body)))
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start
    return list(results), duration_s


def base_url(args: argparse.Namespace) -> str:
    """``--base-url`` (a trailing ``/v1`` is dropped) or ``http://{--host}:{--port}``."""
    url = args.base_url or f"http://{args.host}:{args.port}"
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def fetch_model(url: str, headers: dict[str, str], timeout_s: float = 30.0) -> str:
    """The first model id from ``GET {url}/v1/models``.

    Raises:
        BenchmarkError: the server is unreachable, refuses, or serves no model.
    """
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise BenchmarkError(f"Cannot reach {url}: {e}. Is the server running?") from e
    if response.status_code != 200:
        raise BenchmarkError(f"GET /v1/models: {error_text(response.status_code, response.text)}")
    models = response.json().get("data") or []
    if not models:
        raise BenchmarkError(f"{url} serves no model; pass --model.")
    return models[0]["id"]


def encode_bodies(args: argparse.Namespace, model: str, count: int) -> list[bytes]:
    """The JSON bodies of ``count`` requests, images inline as data URLs (the first
    ``--num-prompts`` are the same whatever ``count`` is: same seed)."""
    requests = random_image_dataset(
        count,
        input_len=args.input_len,
        output_len=args.output_len,
        image_size=tuple(args.image_size),
        num_images=args.num_images,
        seed=args.seed,
    )
    bodies = []
    for request in requests:
        body = {
            "model": model,
            "messages": openai_messages(request),
            "max_tokens": request.output_len,
            "temperature": args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension: generate exactly max_tokens
        bodies.append(json.dumps(body).encode())
    return bodies


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench serve`` flags to ``parser``."""
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", help="Server URL; default http://HOST:PORT.")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument("--model", help="Model name; default: the first of GET /v1/models.")
    target.add_argument("--api-key", help="Sent as 'Authorization: Bearer KEY'.")
    data = parser.add_argument_group("dataset (random words and noise images)")
    data.add_argument("--num-prompts", type=int, default=200, help="Requests to send.")
    data.add_argument("--input-len", type=int, default=50, help="Words of text per prompt.")
    data.add_argument("--output-len", type=int, default=128, help="max_tokens per request.")
    data.add_argument("--image-size", type=int, nargs=2, default=[448, 448], metavar=("W", "H"))
    data.add_argument("--num-images", type=int, default=1, help="Images per request.")
    data.add_argument("--seed", type=int, default=0, help="Seeds the dataset and arrivals.")
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="Requests/s (inf: all at once)."
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="Gamma shape of the gaps; 1 is Poisson."
    )
    load.add_argument("--max-concurrency", type=int, help="Most requests in flight at once.")
    load.add_argument(
        "--num-warmups", type=int, default=0, help="Requests sent first and not measured."
    )
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--ignore-eos", action="store_true", help="Always generate --output-len.")
    load.add_argument("--timeout", type=float, default=6 * 3600.0, help="Per request, in s.")
    report = parser.add_argument_group("report")
    report.add_argument("--percentiles", default="50,90,99", help="Comma-separated, 0-100.")
    report.add_argument("--output-json", metavar="PATH", help="Write the result dict here.")
    report.add_argument("--plot", metavar="PATH.png", help="Write latency histograms here.")
    report.add_argument(
        "--dry-run",
        action="store_true",
        help="Send nothing: print the arrival schedule's statistics (and write its send times "
        "to --output-json as arrival_times).",
    )


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1 or args.output_len < 1 or args.input_len < 0 or args.num_images < 0:
        raise BenchmarkError("Need --num-prompts, --output-len >= 1 and --input-len >= 0.")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise BenchmarkError("--request-rate and --burstiness must be > 0.")
    if args.num_warmups < 0:
        raise BenchmarkError("--num-warmups must be >= 0.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchmarkError("--max-concurrency must be >= 1.")


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark, print its table, write ``--output-json``/``--plot``; returns the
    result dict (see ``serve_metrics.summarize``) plus the run's settings. With ``--dry-run``,
    send nothing and return the schedule (``dry_run``).

    Failed requests are counted in the result, not raised.

    Raises:
        SystemExit: ``error: ...`` for bad arguments, or no model given and none could be
            fetched (a ``BenchmarkError``).
    """
    try:
        _check_args(args)
        return dry_run(args) if args.dry_run else run(args)
    except BenchmarkError as error:
        raise SystemExit(f"error: {error}") from error


def _write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def dry_run(args: argparse.Namespace) -> dict:
    """The arrival schedule of the flags, nothing sent: prints its span, mean gap and the
    gaps' coefficient of variation (1 for Poisson, ``1 / sqrt(burstiness)`` for gamma
    gaps); returns (and writes to ``--output-json``) the settings and ``arrival_times`` (s)."""
    times = arrival_times(args.num_prompts, args.request_rate, args.burstiness, args.seed)
    gaps = np.diff(times)
    mean_ms = float(gaps.mean()) * 1000 if gaps.size else 0.0
    cv = float(gaps.std() / gaps.mean()) if gaps.size and gaps.mean() > 0 else 0.0
    print(
        f"Dry run, nothing sent: {len(times)} requests at {args.request_rate:g} req/s "
        f"(burstiness {args.burstiness:g}) over {times[-1]:.2f} s; mean gap {mean_ms:.2f} ms, "
        f"gap coefficient of variation {cv:.3f}"
    )
    result = {"settings": _settings(args, base_url(args), args.model), "arrival_times": times}
    _write_json(args.output_json, result)
    return result


def run(args: argparse.Namespace) -> dict:
    """The benchmark run of ``main``.

    Raises:
        BenchmarkError: bad ``--percentiles``, or no model given and none could be fetched.
    """
    try:
        percentiles = parse_percentiles(args.percentiles)
    except ValueError as e:
        raise BenchmarkError(str(e)) from e
    url = base_url(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or fetch_model(url, headers)
    bodies = encode_bodies(args, model, args.num_prompts + args.num_warmups)
    bodies, warmups = bodies[: args.num_prompts], bodies[args.num_prompts :]
    config = LoadConfig(
        url=f"{url}{CHAT_PATH}",
        headers={**headers, "Content-Type": "application/json"},
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        timeout_s=args.timeout,
    )
    if warmups:
        logger.info("Sending %d warm-up requests", len(warmups))
        warm = asyncio.run(run_load(warmups, dataclasses.replace(config, request_rate=math.inf)))
        if errors := [r.error for r in warm[0] if not r.success]:
            logger.warning("%d warm-up requests failed, e.g. %s", len(errors), errors[0])
    logger.info("Sending %d requests to %s (model %s)", len(bodies), config.url, model)
    results, duration_s = asyncio.run(run_load(bodies, config))
    summary = summarize(results, duration_s, percentiles)
    summary["settings"] = _settings(args, url, model)
    print(format_table(summary))  # the command's output, as vllm bench serve prints it
    _write_json(args.output_json, summary)
    if args.plot and plot_latencies(results, args.plot):
        logger.info("Wrote the latency plot to %s", args.plot)
    return summary


# The flags a result records as they are.
_SETTINGS = ("num_prompts", "input_len", "output_len", "num_images", "seed", "burstiness",
             "max_concurrency", "num_warmups", "temperature", "ignore_eos")  # fmt: skip


def _settings(args: argparse.Namespace, url: str, model: str) -> dict:
    """The run's settings, JSON-safe (an infinite rate becomes the string "inf")."""
    rate = args.request_rate
    return {
        "base_url": url,
        "model": model,
        **{name: getattr(args, name) for name in _SETTINGS},
        "image_size": list(args.image_size),
        "request_rate": "inf" if math.isinf(rate) else rate,
    }


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(cli)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    main(cli.parse_args())
