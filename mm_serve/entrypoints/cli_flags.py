"""The engine flags of ``mm-serve serve`` and the benchmarks: one per ``EngineArgs`` field
(``--max-model-len``, ``--no-enable-prefix-caching``, ...), with its real default in ``--help``,
and the byte sizes and JSON objects they take."""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import json
import re
import types
import typing
from typing import Any

from mm_serve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs

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
    "kv_cache_dtype": "KV-cache dtype: auto (the model's) or fp8 (e4m3: twice the tokens in the "
    "same memory; needs an sm_89+ GPU or the CPU).",
    "max_num_batched_tokens": "Token budget of one engine step; longer prompts are chunked.",
    "max_num_seqs": "Most requests in one engine step.",
    "enable_chunked_prefill": "Split long prompts over several steps.",
    "scheduling_policy": "fcfs (arrival order) or priority (a request's priority field, lower "
    "first; the lowest priority's newest request is preempted first).",
    "tensor_parallel_size": "Tensor-parallel ranks (GPUs) per model, one worker process each.",
    "data_parallel_size": "Engine core replicas behind the one server, each a whole engine "
    "(on CUDA with mp: its own tensor_parallel_size GPUs); requests go by load and cache "
    "affinity.",
    "distributed_executor_backend": "Tensor-parallel workers as local processes (mp) or as "
    "Ray actors on the cluster's nodes (ray; pip install 'mm_serve[ray]'); uni: one rank in "
    "the engine core's process (mp at one rank: one worker process).",
    "data_parallel_backend": "Data-parallel engine cores as local processes (mp) or as Ray "
    "actors on the cluster's nodes (ray).",
    "device": "auto, cpu or cuda.",
    "max_pixels": "Largest input image accepted, in pixels (width x height); larger: 400.",
    "max_pixels_per_request": "Most pixels of all of one request's images together (as their "
    "headers declare them, checked before any is decoded); more: 400.",
    "processor_max_pixels": "Override of the image processor's resize target, in pixels.",
    "mm_processor_kwargs": "Image processor settings as JSON (vLLM's), e.g. "
    "'{\"max_pixels\": 802816}' for Qwen2-VL; a request's own mm_processor_kwargs apply on top.",
    "mm_processor_cache_gb": "Processor cache size (preprocessed images) in GiB; 0: off.",
    "mm_preprocess_workers": "Image and video preprocessing processes.",
    "max_video_frames": "Most frames of a video after sampling; more: 400.",
    "mm_encoder_tp_mode": "How tensor-parallel ranks run the vision tower (each holds all of "
    "it): weights, every rank encodes every image; data, a step's images split across the "
    "ranks and the embeddings gathered.",
    "max_num_encoder_input_tokens": "Image embedding tokens encoded per step.",
    "encoder_cache_size": "Encoder cache size in image embedding tokens.",
    "enforce_eager": "No CUDA graphs, no compile: run every step eagerly (compilation level 0).",
    "compilation_level": "0: eager; 1: CUDA graphs; 2: torch.compile and CUDA graphs (CUDA only).",
    "load_format": "auto (the checkpoint's weights) or dummy (random weights, for benchmarks).",
    "quantization": "fp8: quantize a bf16 checkpoint's linear layers to FP8 as they load (per "
    "output channel; activations per token). A quantized checkpoint needs no flag.",
    "async_scheduling": "Schedule the next step while the GPU runs this one.",
    "chat_template": "Chat template for chat requests: a Jinja file, or the template text.",
    "kernel_mode": "Kernels of the forward: auto, triton (Triton alone) or ref (pure torch).",
    "pdl": "Programmatic dependent launch of the Triton kernels (Hopper and newer).",
    "runner": "generate, or pooling: serve embeddings (/v1/embeddings, LLM.embed) of the "
    "prompts' final hidden states, e.g. for GME-Qwen2-VL (vLLM's); auto: generate.",
    "pooler_config": "The pooling runner's settings as JSON (vLLM's), e.g. "
    '\'{"pooling_type": "MEAN", "normalize": true}\'; LAST or MEAN.',
    "enable_lora": "Serve PEFT LoRA adapters (lora_request=; runs the engine eagerly).",
    "max_loras": "Most distinct LoRA adapters in one engine step (their GPU slots).",
    "max_lora_rank": "Largest LoRA rank served (the slots' padding): 1, 8, 16, 32, 64, 128, "
    "256, 320 or 512.",
    "max_cpu_loras": "LoRA adapters kept in host memory (least recently used dropped).",
}
# What an EngineArgs field whose default is None resolves to, shown as its default.
_UNSET_DEFAULTS = {
    "max_cpu_loras": "max_loras",
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
    "distributed_executor_backend": "uni at one rank, else mp",
    "chat_template": "the checkpoint's",
    "quantization": "the checkpoint's",
    "kernel_mode": "$MM_SERVE_KERNELS, else auto",
    "pdl": "on, off with MM_SERVE_PDL=0",
    "pooler_config": "the checkpoint's sentence-transformers files, else LAST, normalized",
}


def _scalar_type(hint: Any) -> type:
    """``int | None`` -> int, ``str`` -> str."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def add_flag(
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
        add_flag(group, flag, help_text, field.default, **kwargs)


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
