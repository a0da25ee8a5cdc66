"""The ``mm-serve`` command.

``mm-serve serve [MODEL] [flags]`` runs the OpenAI-compatible server. Its engine flags are made
from the fields of ``EngineArgs`` (``--max-model-len``, ``--no-enable-prefix-caching``, ...) and
its server flags from ``ServerConfig``, defaults included, so that ``--help`` shows the real ones.
``mm-serve chat [IMAGE] QUESTION`` asks a running server a question, about an image or not.
``mm-serve bench {latency,throughput,serve}`` runs a benchmark (``mm_serve/benchmarks/``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import decimal
import functools
import importlib
import json
import logging
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from mm_serve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs

logger = logging.getLogger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")

# Units of byte-size flags: SI (powers of 1000) and IEC (powers of 1024). A bare "G" is
# refused: it means 10**9 to some tools and 2**30 to others.
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_byte_size(text: str) -> int:
    """``"512MiB"`` -> 536870912, ``"1.5GB"`` -> 1500000000, ``"4096"`` -> 4096 (bytes; a
    fraction of a byte is dropped).

    Raises:
        argparse.ArgumentTypeError: not a non-negative number, bare or with one of the units
            B, kB, MB, GB, TB, KiB, MiB, GiB, TiB (in any case).
    """
    match = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*([a-z]*)\s*", text, re.IGNORECASE)
    unit = match and _BYTE_UNITS.get(match[2].lower())
    if not unit:
        raise argparse.ArgumentTypeError(
            f"invalid byte size {text!r}: give bytes or a number with a unit, e.g. 512MiB, "
            "2GiB, 1.5GB (KiB, MiB, GiB, TiB: powers of 1024; kB, MB, GB, TB: of 1000)"
        )
    return int(decimal.Decimal(match[1]) * unit)


def format_byte_size(size: int) -> str:
    """``2 << 30`` -> ``"2GiB"``: the largest binary unit that divides ``size``, else bytes."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


_ENGINE_ARG_HELP = {
    "tokenizer": "Tokenizer folder or hub id.",
    "revision": "Hub revision (branch, tag or commit) of the model.",
    "dtype": "Weight and activation dtype: auto (the checkpoint's), float32, float16, bfloat16.",
    "seed": "Global random seed.",
    "max_model_len": "Prompt + output length limit in tokens.",
    "block_size": "Tokens per KV-cache block.",
    "enable_prefix_caching": "Reuse the KV blocks of identical prompt prefixes.",
    "gpu_memory_utilization": "Fraction of GPU memory for weights, activations and KV cache.",
    "cpu_kv_cache_bytes": "KV-cache budget on CPU (the pool holds at most max_num_seqs x "
    "max_model_len tokens), in bytes or with a unit (512MiB, 2GiB).",
    "num_kv_blocks": "KV-cache size in blocks.",
    "max_num_batched_tokens": "Token budget of one engine step; longer prompts are chunked.",
    "max_num_seqs": "Most requests in one engine step.",
    "enable_chunked_prefill": "Split long prompts over several steps.",
    "tensor_parallel_size": "GPUs per model (only 1 for now).",
    "device": "auto, cpu or cuda.",
    "max_pixels": "Largest input image accepted, in pixels (width x height); larger: 400.",
    "processor_max_pixels": "Override of the image processor's resize target, in pixels.",
    "mm_processor_kwargs": "Image processor settings as JSON (vLLM's), e.g. "
    "'{\"max_pixels\": 802816}' for Qwen2-VL; a request's own mm_processor_kwargs apply on top.",
    "mm_processor_cache_gb": "Processor cache size (preprocessed images) in GiB; 0: off.",
    "mm_preprocess_workers": "Image preprocessing processes.",
    "max_num_encoder_input_tokens": "Image embedding tokens encoded per step.",
    "encoder_cache_size": "Encoder cache size in image embedding tokens.",
    "enforce_eager": "No CUDA graphs: run every step eagerly.",
    "load_format": "auto (the checkpoint's weights) or dummy (random weights, for benchmarks).",
    "async_scheduling": "Schedule the next step while the GPU runs this one.",
    "chat_template": "Chat template for chat requests: a Jinja file, or the template text.",
    "kernel_mode": "Kernels of the forward: auto, triton (Triton alone) or ref (pure torch).",
    "pdl": "Programmatic dependent launch of the Triton kernels (Hopper and newer).",
}
# What an EngineArgs field whose default is None resolves to, shown as its default.
_UNSET_DEFAULTS = {
    "tokenizer": "the model's",
    "revision": "the hub's main branch",
    "max_model_len": "the checkpoint's max_position_embeddings",
    "num_kv_blocks": "what the KV-cache budget holds",
    "max_num_batched_tokens": str(DEFAULT_MAX_NUM_BATCHED_TOKENS),
    "processor_max_pixels": "the checkpoint's",
    "mm_processor_kwargs": "none",
    "mm_preprocess_workers": "half the CPU cores, 1 to 8",
    "max_num_encoder_input_tokens": "max(token budget, largest image)",
    "encoder_cache_size": "max(token budget, largest image)",
    "async_scheduling": "on with CUDA, off on CPU",
    "chat_template": "the checkpoint's",
    "kernel_mode": "$MM_SERVE_KERNELS, else auto",
    "pdl": "on, off with MM_SERVE_PDL=0",
}


def _scalar_type(hint: Any) -> type:
    """``int | None`` -> int, ``str`` -> str."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def _add_flag(
    group: Any, flag: str, help_text: str, default: Any = None, shown: str | None = None, **kwargs
) -> None:
    """``group.add_argument(flag, ...)`` with ``(default: ...)`` at the end of its help, once
    (Python 3.10's ``BooleanOptionalAction`` appends one itself): ``shown``, else ``default``
    (none shown when both are None). A ``--*-bytes`` flag takes units (``parse_byte_size``)."""
    if flag.endswith("-bytes"):
        kwargs["type"] = parse_byte_size
        shown = shown or format_byte_size(default)
    if shown is None and default is not None:
        shown = str(default)
    action = group.add_argument(flag, default=default, help=help_text, **kwargs)
    if shown is not None and "(default:" not in action.help:
        action.help += f" (default: {shown.replace('%', '%%')})"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineArgs`` field but ``model`` (bools: ``--x`` / ``--no-x``), showing
    the field's default, or for a field whose default is None what None resolves to."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        if field.name == "model":
            continue
        kind = _scalar_type(hints[field.name])
        if kind is bool:
            kwargs: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        elif typing.get_origin(kind) is dict:
            kwargs = {"type": _json_object}
        else:
            kwargs = {"type": kind}
        if field.default is None:
            kwargs["shown"] = _UNSET_DEFAULTS.get(field.name, "unset")
        help_text = _ENGINE_ARG_HELP.get(field.name, f"EngineArgs.{field.name}.")
        flag = "--" + field.name.replace("_", "-")
        _add_flag(group, flag, help_text, field.default, **kwargs)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The ``EngineArgs`` of parsed ``serve`` flags."""
    names = [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model"]
    return EngineArgs(model=args.model, **{name: getattr(args, name) for name in names})


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object, e.g. ``--mm-processor-kwargs '{"max_pixels": 802816}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, not {text!r}")
    return value


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
    """The HTTP flags of ``serve``, with the defaults of ``ServerConfig`` and ``MediaConfig``
    (imports the web stack)."""
    from mm_serve.entrypoints.openai.api_server import ServerConfig
    from mm_serve.entrypoints.openai.media import MediaConfig

    server, media = ServerConfig(), MediaConfig()
    add = functools.partial(_add_flag, parser.add_argument_group("server"))
    add("--host", "Address to listen on.", server.host)
    add("--port", "Port to listen on.", server.port, type=int)
    add("--api-key", "Require 'Authorization: Bearer <key>' on /v1/* (401 without).")
    add(
        "--served-model-name",
        "Model names clients may use; the first is reported in responses.",
        list(server.served_model_names),
        shown="the model as given",
        nargs="+",
    )
    add(
        "--allowed-media-domains",
        "Hosts whose http(s) image URLs are fetched.",
        list(media.allowed_domains),
        shown="none",
        nargs="+",
    )
    add("--allowed-local-media-path", "Folder whose files file:// URLs may name.", shown="none")
    add(
        "--limit-mm-per-prompt",
        "Most images per request, as N or '{\"image\": N}'; more: 400.",
        media.max_images,
        type=_images_limit,
    )
    add(
        "--max-request-body-bytes",
        "Larger request bodies get a 413 (bytes, or 64MiB, ...).",
        server.max_request_body_bytes,
    )
    add(
        "--max-media-bytes",
        "Largest image fetched from a URL or read from a file (bytes, or 20MiB, ...).",
        media.max_bytes,
    )
    add(
        "--media-fetch-timeout",
        "Time limit of an image URL fetch, in seconds.",
        media.fetch_timeout_s,
        type=float,
    )
    add(
        "--max-concurrent-requests",
        "Generation requests in flight beyond this get a 429.",
        server.max_concurrent_requests,
        type=int,
    )
    add(
        "--log-level",
        "Level of mm_serve's and uvicorn's loggers.",
        server.log_level,
        choices=LOG_LEVELS,
    )


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
        log_level=args.log_level,
    )


# A small Qwen2-VL trained on generated scenes (samples/demo_vlm/): runs on any CPU, offline.
DEMO_MODEL = Path(__file__).resolve().parents[2] / "samples" / "demo_vlm" / "model"
DEMO_MODEL_NAME = "mm-serve-demo-vlm"


def serve(args: argparse.Namespace) -> int:
    """``mm-serve serve``: returns the exit code (1: bad options, failed start, engine died)."""
    from mm_serve.entrypoints.openai.api_server import run_server
    from mm_serve.frontend.exceptions import EngineStartupError

    try:
        return asyncio.run(run_server(engine_args_from(args), server_config_from(args)))
    except (ValueError, EngineStartupError) as e:
        logger.error("Cannot serve %s: %s", args.model, e)
        return 1


def chat(args: argparse.Namespace) -> int:
    """``mm-serve chat``: stream the answer to stdout; returns the exit code."""
    from mm_serve.client import Client

    client = Client(base_url=args.url, api_key=args.api_key)
    images = []
    if args.image is not None:
        images.append(args.image if "://" in args.image else Path(args.image))
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


# bench subcommand (a module of mm_serve.benchmarks) -> help. Each module has
# add_cli_args(parser) and main(args) -> dict; only the chosen one is imported, so that the
# offline benchmarks never import the web stack (`bench serve` needs httpx only).
BENCH_COMMANDS = {
    "latency": "Latency of one batch through the offline engine, and the decode step.",
    "throughput": "Offline throughput of many requests, against HF transformers (or vLLM).",
    "serve": "Load-test a running OpenAI-compatible server (TTFT, TPOT, ITL).",
    "kernels": "Attention (ours vs cuDNN SDPA and FlashAttention) and the other kernels (GPU).",
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
    serve_parser.set_defaults(func=serve)


def add_chat_parser(commands) -> None:
    """``chat [IMAGE] QUESTION``: one argument is the question, two are image and question."""
    chat_parser = commands.add_parser("chat", help="Ask a running server (about an image).")
    chat_parser.add_argument("image", nargs="?", help="Image file or URL (optional).")
    chat_parser.add_argument("question")
    add = functools.partial(_add_flag, chat_parser)
    add("--url", "Server URL.", "http://127.0.0.1:8000")
    add("--api-key", "The server's API key, if it needs one.")
    add("--max-tokens", "Most tokens in the answer.", 256, type=int)
    add("--temperature", "Sampling temperature; 0: greedy.", shown="the server's", type=float)
    chat_parser.set_defaults(func=chat)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``mm-serve`` parser with its ``serve``, ``chat`` and ``bench`` subcommands (the
    flags of ``serve`` and of ``bench X`` are added only when ``argv``, default
    ``sys.argv[1:]``, names them)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="mm-serve", description="Serve vision-language models; ask a server; benchmark."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands, argv)
    add_chat_parser(commands)
    add_bench_parser(commands, argv)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mm-serve``; returns the exit code."""
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command == "chat" and args.image is None and os.path.isfile(args.question):
        parser.error(
            f"{args.question!r} is a file: ask a question too (mm-serve chat IMAGE QUESTION)."
        )
    level = getattr(args, "log_level", "info" if args.command == "bench" else "warning")
    level = logging.getLevelName(level.upper())
    # Other libraries' loggers stay at WARNING (or above): --log-level debug is about ours.
    logging.basicConfig(
        level=max(level, logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("mm_serve").setLevel(level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
