"""The ``mm-serve`` command.

``mm-serve serve MODEL [flags]`` runs the OpenAI-compatible server; its engine flags are made
from the fields of ``EngineArgs`` (``--max-model-len``, ``--no-enable-prefix-caching``, ...).
``mm-serve chat IMAGE "question"`` asks a running server about an image from the terminal.
``mm-serve bench {latency,throughput,serve}`` runs a benchmark (``mm_serve/benchmarks/``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib
import json
import logging
import sys
import types
import typing
from pathlib import Path

from mm_serve.config import EngineArgs

logger = logging.getLogger(__name__)

_ENGINE_ARG_HELP = {
    "tokenizer": "Tokenizer folder or hub id; the model's when unset.",
    "revision": "Hub revision (branch, tag or commit) of the model.",
    "dtype": "Weight and activation dtype: auto (the checkpoint's), float32, float16, bfloat16.",
    "seed": "Global random seed.",
    "max_model_len": "Prompt + output length limit in tokens; config.json's when unset.",
    "block_size": "Tokens per KV-cache block.",
    "enable_prefix_caching": "Reuse the KV blocks of identical prompt prefixes.",
    "gpu_memory_utilization": "Fraction of GPU memory for weights, activations and KV cache.",
    "cpu_kv_cache_bytes": "KV-cache size on CPU, in bytes.",
    "num_kv_blocks": "KV-cache size in blocks; found by profiling when unset.",
    "max_num_batched_tokens": "Token budget of one engine step; longer prompts are chunked.",
    "max_num_seqs": "Most requests in one engine step.",
    "enable_chunked_prefill": "Split long prompts over several steps.",
    "tensor_parallel_size": "GPUs per model (only 1 for now).",
    "device": "auto, cpu or cuda.",
    "max_pixels": "Largest input image accepted, in pixels (width x height); larger: 400.",
    "processor_max_pixels": "Override of the image processor's resize target, in pixels.",
    "mm_processor_cache_gb": "Processor cache size (preprocessed images) in GiB; 0: off.",
    "mm_preprocess_workers": "Image preprocessing processes; half the cores (1..8) when unset.",
    "max_num_encoder_input_tokens": "Image embedding tokens encoded per step; the token "
    "budget when unset.",
    "encoder_cache_size": "Encoder cache size in embedding tokens; the token budget when unset.",
    "enforce_eager": "No CUDA graphs: run every step eagerly.",
    "load_format": "auto (the checkpoint's weights) or dummy (random weights, for benchmarks).",
    "async_scheduling": "Schedule the next step while the GPU runs this one (default: on GPU).",
}


def _scalar_type(hint: typing.Any) -> type:
    """``int | None`` -> int, ``str`` -> str."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineArgs`` field but ``model`` (bools: ``--x`` / ``--no-x``)."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        if field.name == "model":
            continue
        kind = _scalar_type(hints[field.name])
        help_text = _ENGINE_ARG_HELP.get(field.name, f"EngineArgs.{field.name}.")
        help_text += " (default: %(default)s)"
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            action = argparse.BooleanOptionalAction
            group.add_argument(flag, action=action, default=field.default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=field.default, help=help_text)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The ``EngineArgs`` of parsed ``serve`` flags."""
    names = [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model"]
    return EngineArgs(model=args.model, **{name: getattr(args, name) for name in names})


def _images_limit(text: str) -> int:
    """``4`` or vLLM's ``{"image": 4}``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict) and set(value) <= {"image"}:
        value = value.get("image")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a count or '{{\"image\": N}}', not {text!r}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP flags of ``serve`` (``ServerConfig``, ``MediaConfig``)."""
    group = parser.add_argument_group("server")
    add = group.add_argument
    add("--host", default="127.0.0.1", help="Address to listen on (default: %(default)s).")
    add("--port", type=int, default=8000, help="Port to listen on (default: %(default)s).")
    add("--api-key", help="Require 'Authorization: Bearer <key>' on /v1/* (401 without).")
    add("--served-model-name", nargs="+", default=[], help="Model names clients may use "
        "(default: the model as given); the first is reported in responses.")  # fmt: skip
    add("--allowed-media-domains", nargs="+", default=[], help="Hosts whose http(s) image "
        "URLs are fetched (default: none).")  # fmt: skip
    add("--allowed-local-media-path", help="Folder whose files file:// image URLs may name.")
    add("--limit-mm-per-prompt", type=_images_limit, default=16, help="Most images per "
        "request, as N or '{\"image\": N}' (default: %(default)s); more: 400.")  # fmt: skip
    add("--max-request-body-bytes", type=int, default=64 << 20, help="Larger request bodies "
        "get a 413 (default: %(default)s).")  # fmt: skip
    add("--max-media-bytes", type=int, default=20 << 20, help="Largest image fetched from a "
        "URL or read from a file, in bytes (default: %(default)s).")  # fmt: skip
    add("--media-fetch-timeout", type=float, default=10.0, help="Time limit of an image URL "
        "fetch, in seconds (default: %(default)s).")  # fmt: skip
    add("--max-concurrent-requests", type=int, default=1024, help="Generation requests in "
        "flight beyond this get a 429 (default: %(default)s).")  # fmt: skip


def server_config_from(args: argparse.Namespace):
    """The ``ServerConfig`` of parsed ``serve`` flags."""
    from mm_serve.entrypoints.openai.api_server import ServerConfig
    from mm_serve.entrypoints.openai.media import MediaConfig

    media = MediaConfig(
        allowed_domains=tuple(args.allowed_media_domains),
        allowed_local_path=args.allowed_local_media_path,
        max_bytes=args.max_media_bytes,
        fetch_timeout_s=args.media_fetch_timeout,
        max_images=args.limit_mm_per_prompt,
    )
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=tuple(args.served_model_name)
        or ((DEMO_MODEL_NAME,) if args.model == str(DEMO_MODEL) else ()),
        media=media,
        max_request_body_bytes=args.max_request_body_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
    )


# A small Qwen2-VL trained on generated scenes (samples/demo_vlm/): runs on any CPU, offline.
DEMO_MODEL = Path(__file__).resolve().parents[2] / "samples" / "demo_vlm" / "model"
DEMO_MODEL_NAME = "mm-serve-demo-vlm"


def serve(args: argparse.Namespace) -> int:
    """``mm-serve serve``: returns the exit code (1: bad options, failed start, engine died)."""
    from mm_serve.engine.exceptions import EngineStartupError
    from mm_serve.entrypoints.openai.api_server import run_server

    try:
        return asyncio.run(run_server(engine_args_from(args), server_config_from(args)))
    except (ValueError, EngineStartupError) as e:
        logger.error("Cannot serve %s: %s", args.model, e)
        return 1


def chat(args: argparse.Namespace) -> int:
    """``mm-serve chat``: stream the answer to stdout; returns the exit code."""
    from mm_serve.client import Client

    client = Client(base_url=args.url, api_key=args.api_key)
    image = args.image if "://" in args.image else Path(args.image)
    try:
        chunks = client.chat(
            text=args.question, images=[image], stream=True, max_tokens=args.max_tokens
        )
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                sys.stdout.write(chunk.choices[0].delta.content)
                sys.stdout.flush()
    except Exception as e:  # whatever the server or the connection said, said plainly
        print(f"\nmm-serve chat: {e}", file=sys.stderr)
        return 1
    print()
    return 0


# bench subcommand (a module of mm_serve.benchmarks) -> help. Each module has
# add_cli_args(parser) and main(args) -> dict; only the chosen one is imported, so that the
# offline benchmarks never import the web stack (`bench serve` needs httpx only).
BENCH_COMMANDS = {
    "latency": "Latency of one batch through the offline engine, and the decode step.",
    "throughput": "Offline throughput of many requests, against HF transformers.",
    "serve": "Load-test a running OpenAI-compatible server (TTFT, TPOT, ITL).",
}


def _bench(module: types.ModuleType, args: argparse.Namespace) -> int:
    module.main(args)  # prints its table, writes --output-json
    return 0


def add_bench_parser(commands, argv: list[str]) -> None:
    """``bench`` and its subcommands; the flags of the one named in ``argv`` only."""
    bench = commands.add_parser("bench", help="Run a benchmark.")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    chosen = argv[1] if len(argv) > 1 and argv[0] == "bench" else None
    for name, help_text in BENCH_COMMANDS.items():
        sub = kinds.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(f"mm_serve.benchmarks.{name}")
            module.add_cli_args(sub)
            sub.set_defaults(func=functools.partial(_bench, module))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``mm-serve`` parser with its ``serve``, ``chat`` and ``bench`` subcommands (the
    flags of ``bench X`` are added only when ``argv``, default ``sys.argv[1:]``, names X)."""
    parser = argparse.ArgumentParser(prog="mm-serve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="Run the OpenAI-compatible API server.")
    serve_parser.add_argument(
        "model",
        nargs="?",
        default=str(DEMO_MODEL),
        help="Checkpoint folder or Hugging Face hub id (default: the bundled demo VLM, "
        "samples/demo_vlm/model).",
    )
    add_server_args(serve_parser)
    add_engine_args(serve_parser)
    serve_parser.set_defaults(func=serve)
    chat_parser = commands.add_parser("chat", help="Ask a running server about an image.")
    chat_parser.add_argument("image", help="Image file or URL.")
    chat_parser.add_argument("question")
    chat_parser.add_argument("--url", default="http://127.0.0.1:8000", help="Server URL.")
    chat_parser.add_argument("--api-key", help="The server's API key, if it needs one.")
    chat_parser.add_argument("--max-tokens", type=int, default=256)
    chat_parser.set_defaults(func=chat)
    add_bench_parser(commands, sys.argv[1:] if argv is None else argv)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mm-serve``; returns the exit code."""
    args = build_parser(argv).parse_args(argv)
    level = logging.INFO if args.command in ("serve", "bench") else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
