"""The ``mm-serve`` command.

``mm-serve serve [MODEL] [flags]`` runs the OpenAI-compatible server. Its engine flags are made
from the fields of ``EngineArgs`` (``cli_flags.py``) and its server flags from ``ServerConfig``,
defaults included, so that ``--help`` shows the real ones.
``mm-serve run-batch [MODEL] -i FILE -o FILE`` answers a file of OpenAI batch requests offline.
``mm-serve chat [IMAGE] QUESTION`` asks a running server a question, about an image or not.
``mm-serve bench COMMAND`` runs a benchmark (``BENCH_COMMANDS``, ``mm_serve/benchmarks/``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import importlib.metadata
import importlib.resources
import json
import logging
import os
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

from mm_serve.entrypoints.cli_flags import add_engine_args, add_flag, engine_args_from
from mm_serve.utils.logs import configure_logging

if TYPE_CHECKING:  # zmq: not for the offline benchmarks
    from mm_serve.frontend.engine_process import EngineProcess

logger = logging.getLogger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")


def _mm_limits(text: str) -> dict[str, int]:
    """``4`` (images) or vLLM's ``{"image": 4, "video": 1}`` → the limits given."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    limits = value if isinstance(value, dict) else {"image": value}
    counts = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limits.values())
    if not limits or set(limits) - {"image", "video"} or not counts:
        raise argparse.ArgumentTypeError(
            f'expected a count or \'{{"image": N, "video": M}}\', not {text!r}'
        )
    return limits


def _add_lora_modules_flag(add) -> None:
    """``--lora-modules``, for ``serve`` and ``run-batch``."""
    add(
        "--lora-modules",
        "LoRA adapters served beside the model (needs --enable-lora), each as name=path or "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request names one in model.',
        [],
        shown="none",
        nargs="+",
        type=_lora_module,
    )


def _lora_module(text: str):
    """``--lora-modules``' ``name=path`` or JSON (``LoRAModulePath.parse``)."""
    from mm_serve.entrypoints.openai.serving_models import LoRAModulePath

    try:
        return LoRAModulePath.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# The API key's environment variables, ours first; vLLM's is read too, for its users.
API_KEY_ENV = ("MM_SERVE_API_KEY", "VLLM_API_KEY")
KEY_SHOWN = " or ".join(f"${name}" for name in API_KEY_ENV)  # the help never shows the key


def api_key_from_env() -> str | None:
    """The API key from the first of ``API_KEY_ENV`` that is set, else None."""
    return next((os.environ[name] for name in API_KEY_ENV if os.environ.get(name)), None)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP flags of ``serve``, with the defaults of ``ServerConfig`` and ``MediaConfig``
    (imports the web stack)."""
    from mm_serve.entrypoints.openai.api_server import ServerConfig

    server = ServerConfig()
    add = functools.partial(add_flag, parser.add_argument_group("server"))
    add("--host", "Address to listen on.", server.host)
    add("--port", "Port to listen on.", server.port, type=int)
    add(
        "--api-key",
        "Require 'Authorization: Bearer <key>' on /v1/* (401 without). Better given in the "
        "environment: a flag shows in every user's `ps`.",
        api_key_from_env(),
        shown=KEY_SHOWN,
    )
    add(
        "--served-model-name",
        "Model names clients may use; the first is reported in responses.",
        list(server.served_model_names),
        shown="the model as given",
        nargs="+",
    )
    add(
        "--max-request-body-bytes",
        "Larger request bodies get a 413 (bytes, or 64MiB, ...).",
        server.max_request_body_bytes,
    )
    add(
        "--max-concurrent-requests",
        "Generation sequences in flight (a request's n count n) beyond this get a 429.",
        server.max_concurrent_requests,
        type=int,
    )
    add("--max-n", "Most completions (n) or beams one request may ask for.", server.max_n, type=int)
    add(
        "--log-level",
        "Level of mm_serve's and uvicorn's loggers.",
        server.log_level,
        choices=LOG_LEVELS,
    )
    add(
        "--shutdown-timeout",
        "Seconds the requests in flight at SIGTERM get to finish (new connections are refused "
        "meanwhile); then the rest are cut and the server exits.",
        server.shutdown_timeout,
        type=float,
    )
    _add_lora_modules_flag(add)
    add(
        "--api-server-count",
        "API-server processes (HTTP, tokenizing, image preprocessing) sharing the port and the "
        "one engine core.",
        server.api_server_count,
        type=int,
    )
    add(
        "--otlp-traces-endpoint",
        "OTLP/HTTP collector (http://host:4318/v1/traces) that gets a span per request; "
        "needs pip install 'mm_serve[otel]'.",
        shown="no tracing",
    )
    _add_media_args(parser)


def _add_media_args(parser: argparse.ArgumentParser) -> None:
    """Where ``serve`` may fetch images and videos from, and how many and how large."""
    from mm_serve.entrypoints.openai.media import MediaConfig

    media = MediaConfig()
    add = functools.partial(add_flag, parser.add_argument_group("media"))
    add(
        "--allowed-media-domains",
        "Hosts whose http(s) image and video URLs are fetched.",
        list(media.allowed_domains),
        shown="none",
        nargs="+",
    )
    add("--allowed-local-media-path", "Folder whose files file:// URLs may name.", shown="none")
    add(
        "--limit-mm-per-prompt",
        'Most images and videos per request, as N (images) or \'{"image": N, "video": M}\'; '
        "more: 400.",
        {},
        shown=f'{{"image": {media.max_images}, "video": {media.max_videos}}}',
        type=_mm_limits,
    )
    add(
        "--max-media-bytes",
        "Largest image or video fetched from a URL or read from a file (bytes, or 20MiB, ...).",
        media.max_bytes,
    )
    add(
        "--media-fetch-timeout",
        "Time limit of an image or video URL fetch, in seconds.",
        media.fetch_timeout_s,
        type=float,
    )


def media_config_from(args: argparse.Namespace):
    """The ``MediaConfig`` of parsed media flags (``_add_media_args``)."""
    from mm_serve.entrypoints.openai.media import MediaConfig

    return MediaConfig(
        allowed_domains=tuple(args.allowed_media_domains),
        allowed_local_path=args.allowed_local_media_path,
        max_bytes=args.max_media_bytes,
        fetch_timeout_s=args.media_fetch_timeout,
        max_images=args.limit_mm_per_prompt.get("image", MediaConfig.max_images),
        max_videos=args.limit_mm_per_prompt.get("video", MediaConfig.max_videos),
    )


def served_model_names(args: argparse.Namespace) -> tuple[str, ...]:
    """``--served-model-name``, else the demo model's name when serving it, else none."""
    return tuple(args.served_model_name) or (
        (DEMO_MODEL_NAME,) if args.model == str(DEMO_MODEL) else ()
    )


def server_config_from(args: argparse.Namespace):
    """The ``ServerConfig`` of parsed ``serve`` flags.

    Raises:
        ValueError: ``--lora-modules`` without ``--enable-lora``; runtime adapter loading
            (``MM_SERVE_ALLOW_RUNTIME_LORA_UPDATING``) with several API servers, each of which
            would hold its own list.
    """
    from mm_serve.entrypoints.openai.api_server import ServerConfig
    from mm_serve.entrypoints.openai.serving_models import runtime_lora_updating

    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    if args.enable_lora and args.api_server_count > 1 and runtime_lora_updating():
        raise ValueError(
            "Runtime LoRA loading (MM_SERVE_ALLOW_RUNTIME_LORA_UPDATING) needs one API server: "
            "each of --api-server-count's processes would hold its own adapters."
        )

    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=served_model_names(args),
        media=media_config_from(args),
        max_request_body_bytes=args.max_request_body_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
        max_n=args.max_n,
        log_level=args.log_level,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        shutdown_timeout=args.shutdown_timeout,
        lora_modules=tuple(args.lora_modules),
        api_server_count=args.api_server_count,
    )


# A small Qwen2-VL trained on generated scenes (samples/demo_vlm/): runs on any CPU, offline.
# Its checkpoint folder is the package data mm_serve.demo_model (samples/demo_vlm/model).
DEMO_MODEL = Path(str(importlib.resources.files("mm_serve.demo_model")))
DEMO_MODEL_NAME = "mm-serve-demo-vlm"


def serve(args: argparse.Namespace, engine_process: EngineProcess | None = None) -> int:
    """``mm-serve serve``: returns the exit code (1: bad options, failed start, engine died).
    ``engine_process``: the engine core process, started before the flags were parsed."""
    from mm_serve.entrypoints.openai.api_server import run_server
    from mm_serve.entrypoints.openai.multi_api_server import run_multi_api_server
    from mm_serve.frontend.exceptions import EngineStartupError

    logger.info("mm-serve serve %s (pid %d)", args.model, os.getpid())
    try:
        server_config = server_config_from(args)
        engine_args = engine_args_from(args)
        if server_config.api_server_count != 1:
            return run_multi_api_server(engine_args, server_config, engine_process)
        return asyncio.run(run_server(engine_args, server_config, engine_process))
    except (ValueError, OSError, EngineStartupError) as e:
        logger.error("Cannot serve %s: %s", args.model, e)
        return 1


def chat(args: argparse.Namespace) -> int:
    """``mm-serve chat``: stream the answer to stdout; returns the exit code."""
    from mm_serve.client import Client

    client = Client(base_url=args.url, api_key=args.api_key)
    image = args.image
    images = [] if image is None else [image if "://" in image else Path(image)]
    try:
        params = {"max_tokens": args.max_tokens}
        if args.temperature is not None:
            params["temperature"] = args.temperature
        chunks = client.chat(text=args.question, images=images, stream=True, **params)
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                sys.stdout.write(chunk.choices[0].delta.content)
                sys.stdout.flush()
    except Exception as e:  # whatever the server or the connection said, said plainly
        print(f"\nmm-serve chat: {e}", file=sys.stderr)
        return 1
    print()
    return 0


# bench subcommand -> (its module in mm_serve.benchmarks, help). Each module has
# add_cli_args(parser) and main(args) -> its result; only the chosen one is imported, so that
# the offline benchmarks never import the web stack (`bench serve` needs httpx only).
BENCH_COMMANDS = {
    "latency": ("latency", "Latency of one batch offline, and its decode step."),
    "throughput": ("throughput", "Offline throughput against HF transformers or vLLM."),
    "serve": ("serve", "Load-test a running server (TTFT, TPOT, ITL)."),
    "peer-serve": ("peer_serve", "vLLM's bench serve against mm-serve and vLLM (GPU)."),
    "kernels": ("kernels", "Attention and the other kernels against references (GPU)."),
    "roofline": ("roofline", "A workload's roofline at given or measured GPU rates."),
    "step": ("step_profile", "A decode step's host phases and device time (GPU)."),
    "host-overhead": ("host_overhead", "The engine core's host work per decode step."),
    "startup": ("startup", "Seconds from `mm-serve serve` to healthy, first and cached."),
    "architecture": ("architectures", "Write a published architecture's weightless folder."),
}


def _bench(module: types.ModuleType, args: argparse.Namespace) -> int:
    module.main(args)  # prints its table, writes --output-json
    return 0


def add_bench_parser(commands, argv: list[str]) -> None:
    """``bench`` and its subcommands; the flags of the one named in ``argv`` only."""
    bench = commands.add_parser("bench", help="Run a benchmark.")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    chosen = argv[1] if len(argv) > 1 and argv[0] == "bench" else None
    for name, (module_name, help_text) in BENCH_COMMANDS.items():
        sub = kinds.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(f"mm_serve.benchmarks.{module_name}")
            module.add_cli_args(sub)
            sub.set_defaults(func=functools.partial(_bench, module))


def add_serve_parser(commands, argv: list[str]) -> None:
    """``serve``; its flags only when ``argv`` names it (they import the web stack)."""
    serve_parser = commands.add_parser("serve", help="Run the OpenAI-compatible API server.")
    serve_parser.add_argument(
        "model",
        nargs="?",
        default=str(DEMO_MODEL),
        help="Checkpoint folder or Hugging Face hub id (default: the bundled demo VLM, "
        "samples/demo_vlm/model).",
    )
    if argv[:1] == ["serve"]:
        add_server_args(serve_parser)
        add_engine_args(serve_parser)


def add_run_batch_parser(commands, argv: list[str]) -> None:
    """``run-batch``; its flags only when ``argv`` names it (they import the web stack)."""
    parser = commands.add_parser(
        "run-batch", help="Answer a file of OpenAI batch requests offline (vLLM's run-batch)."
    )
    parser.add_argument("model", nargs="?", default=str(DEMO_MODEL), help="As for serve.")
    parser.set_defaults(func=run_batch)
    if argv[:1] != ["run-batch"]:
        return
    from mm_serve.entrypoints.openai.api_server import ServerConfig

    server = ServerConfig()
    batch = parser.add_argument_group("batch")
    batch.add_argument(
        "-i", "--input-file", required=True, help="Requests, one per line; -: stdin."
    )
    batch.add_argument("-o", "--output-file", required=True, help="Results file; -: stdout.")
    add = functools.partial(add_flag, batch)
    add("--served-model-name", "Names the requests' model may give.", [], nargs="+",
        shown="the model as given")  # fmt: skip
    add("--max-concurrent-requests", "Lines in the engine at once.", 256, type=int)
    add("--max-n", "Most completions (n) or beams one request may ask for.", server.max_n,
        type=int)  # fmt: skip
    add("--log-level", "Level of mm_serve's loggers.", "warning", choices=LOG_LEVELS)
    _add_lora_modules_flag(add)
    _add_media_args(parser)
    add_engine_args(parser)


def run_batch(args: argparse.Namespace) -> int:
    """``mm-serve run-batch``: 0 when every line was answered, 1 when some lines got an error
    (their error lines are written) or the engine could not start."""
    from mm_serve.entrypoints.openai.api_server import ServerConfig
    from mm_serve.entrypoints.openai.run_batch import run_batch as answer_file
    from mm_serve.frontend.exceptions import EngineStartupError

    config = ServerConfig(
        served_model_names=served_model_names(args),
        media=media_config_from(args),
        max_concurrent_requests=args.max_concurrent_requests,
        max_n=args.max_n,
        lora_modules=tuple(args.lora_modules),
    )
    try:
        if args.lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora.")
        coroutine = answer_file(engine_args_from(args), config, args.input_file, args.output_file)
        failed = asyncio.run(coroutine)
    except (ValueError, OSError, EngineStartupError) as e:
        logger.error("Cannot run the batch: %s", e)
        return 1
    if failed:
        logger.warning("%d lines got an error (see their error field).", failed)
    return 1 if failed else 0


def add_chat_parser(commands) -> None:
    """``chat [IMAGE] QUESTION``: one argument is the question, two are image and question."""
    chat_parser = commands.add_parser("chat", help="Ask a running server (about an image).")
    chat_parser.add_argument("image", nargs="?", help="Image file or URL (optional).")
    chat_parser.add_argument("question")
    add = functools.partial(add_flag, chat_parser)
    add("--url", "Server URL.", "http://127.0.0.1:8000")
    add("--api-key", "The server's API key, if it needs one.", api_key_from_env(), shown=KEY_SHOWN)
    add("--max-tokens", "Most tokens in the answer.", 256, type=int)
    add("--temperature", "Sampling temperature; 0: greedy.", shown="the server's", type=float)
    chat_parser.set_defaults(func=chat)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``mm-serve`` parser with its ``serve``, ``run-batch``, ``chat`` and ``bench``
    subcommands (the flags of ``serve``, ``run-batch`` and ``bench X`` are added only when
    ``argv``, default ``sys.argv[1:]``, names them)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="mm-serve", description="Serve vision-language models; ask a server; benchmark."
    )
    version = importlib.metadata.version("mm_serve")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands, argv)
    add_run_batch_parser(commands, argv)
    add_chat_parser(commands)
    add_bench_parser(commands, argv)
    return parser


def main(argv: list[str] | None = None, engine_process: EngineProcess | None = None) -> int:
    """Entry point of ``mm-serve``; returns the exit code. ``engine_process``: ``serve``'s
    engine core process, started first by the console script (``launch.main``)."""
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command == "chat" and args.image is None and os.path.isfile(args.question):
        parser.error(
            f"{args.question!r} is a file: ask a question too (mm-serve chat IMAGE QUESTION)."
        )
    configure_logging(getattr(args, "log_level", "info" if args.command == "bench" else "warning"))
    if args.command == "serve":
        return serve(args, engine_process)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
