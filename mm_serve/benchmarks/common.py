"""What ``bench latency``, ``bench throughput`` and the profiling scripts share: the model flags
(a real checkpoint or an architecture with random weights), the engine flags, prompts and
result files.

Imports no web stack (fastapi, zmq): the offline benchmarks run on a bare GPU image.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import platform
from typing import Any

import torch

from mm_serve.benchmarks.architectures import architecture_names, write_architecture
from mm_serve.benchmarks.datasets import BenchRequest, random_image_dataset
from mm_serve.config import EngineArgs

logger = logging.getLogger(__name__)

# The image placeholder a raw prompt carries per image, by config.json model_type.
IMAGE_PLACEHOLDERS = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "llava": "<image>\n",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl_moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "idefics3": "<image>",
    "internvl": "<IMG_CONTEXT>\n",
    "llava_onevision": "<image>\n",
    "gemma3": "<start_of_image>",
}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model FOLDER`` or ``--model-arch NAME``, the workload's seed, and every engine flag
    of ``mm-serve serve`` (``--max-num-seqs``, ``--enforce-eager``, ``--no-async-scheduling``,
    ...; ``--seed`` seeds the engine and the synthetic requests alike)."""
    from mm_serve.entrypoints.cli_flags import add_engine_args

    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        help="A checkpoint folder or hub id, loaded with --load-format (default auto: its "
        "weights). When unset, --model-arch is used.",
    )
    group.add_argument(
        "--model-arch",
        default="qwen2-vl-2b",
        choices=architecture_names(),
        help="A real architecture from its published config.json, with random weights "
        "(load_format=dummy) and a small stand-in tokenizer (default: %(default)s).",
    )
    group.add_argument(
        "--engine-core-in-process",
        action="store_true",
        help="Run LLM's engine core in this process (default: its own process on CUDA).",
    )
    add_engine_args(parser)


def add_image_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("images")
    group.add_argument(
        "--image-size",
        type=int,
        nargs=2,
        default=[448, 448],
        metavar=("WIDTH", "HEIGHT"),
        help="Noise image size in pixels (default: 448 448, 256 image tokens on Qwen2-VL).",
    )
    group.add_argument("--num-images", type=int, default=1, help="Images per request.")


def add_varied_size_arg(parser: argparse.ArgumentParser) -> None:
    """``--max-image-size``: photos of varied sizes (``random_image_dataset``'s
    ``max_image_size``), for the scripts that read it."""
    parser.add_argument(
        "--max-image-size",
        type=int,
        nargs=2,
        metavar=("WIDTH", "HEIGHT"),
        help="Photos of varied sizes: each image's width and height drawn uniformly from "
        "--image-size's up to these.",
    )


def model_folder(args: argparse.Namespace, workdir: str) -> tuple[str, str]:
    """``(folder, load_format)``: ``--model`` as given, or ``--model-arch`` written into
    ``workdir`` with ``load_format="dummy"``."""
    if args.model:
        return args.model, args.load_format
    folder = write_architecture(args.model_arch, os.path.join(workdir, args.model_arch))
    return folder, "dummy"


def engine_kwargs(args: argparse.Namespace, load_format: str, **overrides: Any) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments of the parsed engine flags (all ``EngineArgs`` fields
    but ``model``), with ``load_format`` and ``overrides`` applied."""
    names = [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model"]
    kwargs = {name: getattr(args, name) for name in names}
    kwargs["load_format"] = load_format
    if getattr(args, "engine_core_in_process", False):
        kwargs["multiprocess"] = False
    kwargs.update(overrides)
    return kwargs


def prompt_texts(requests: list[BenchRequest], model_type: str) -> list[str]:
    """One raw prompt per request: its random words, then one placeholder per image.

    No chat template: its fixed system prompt would be a prefix shared by every request, and
    a throughput workload must get no prefix-cache hits. Starting with random words, prompts
    differ from their first tokens.
    """
    if any(r.images for r in requests) and model_type not in IMAGE_PLACEHOLDERS:
        raise ValueError(f"No image placeholder known for model type {model_type!r}.")
    placeholder = IMAGE_PLACEHOLDERS.get(model_type, "")
    return [r.prompt + placeholder * len(r.images) for r in requests]


def llm_prompts(requests: list[BenchRequest], texts: list[str]) -> list[dict[str, Any]]:
    """The prompts as ``LLM.generate`` takes them (PIL images in ``multi_modal_data``)."""
    return [
        {"prompt": text, "multi_modal_data": {"image": list(r.images)}} if r.images else text
        for r, text in zip(requests, texts, strict=True)
    ]


def image_prompts(requests: list[BenchRequest], model_type: str) -> list[dict[str, Any] | str]:
    """``llm_prompts`` of ``requests`` with their ``prompt_texts`` for ``model_type``."""
    return llm_prompts(requests, prompt_texts(requests, model_type))


def args_dataset(args: argparse.Namespace, count: int, seed: int) -> list[BenchRequest]:
    """``count`` requests of the workload flags (``--input-len``, ``--output-len``, the image
    flags and ``--max-image-size``), random words and noise images of ``seed``."""
    size, largest = tuple(args.image_size), args.max_image_size and tuple(args.max_image_size)
    return random_image_dataset(
        count, args.input_len, args.output_len, size, args.num_images, seed, largest
    )


def result_header(
    args: argparse.Namespace, load_format: str, config: Any, workload: dict[str, Any]
) -> dict[str, Any]:
    """The first fields of a benchmark's result: the model (``--model`` or ``--model-arch``),
    its ``load_format``, the device and dtype of the engine ``config`` (an ``EngineConfig``),
    the ``workload`` and the engine flags (``engine_kwargs``)."""
    return {
        "model": args.model or args.model_arch,
        "load_format": load_format,
        "device": device_name(config.device),
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "workload": workload,
        "engine_args": engine_kwargs(args, load_format),
    }


def image_workload(args: argparse.Namespace, no_image: bool = False) -> dict[str, Any]:
    """The workload fields of the prompt and image flags: words (``--input-len``), output
    tokens, ``--num-images`` images of ``--image-size`` (0 and None with ``no_image``), seed."""
    return {
        "input_len_words": args.input_len,
        "output_len": args.output_len,
        "image_size": None if no_image else list(args.image_size),
        "num_images": 0 if no_image else args.num_images,
        "seed": args.seed,
    }


def run_figures(outputs: list[Any], elapsed: float, output_len: int) -> dict[str, Any]:
    """Request and token rates of one timed ``generate`` (ours or vLLM's: both outputs carry
    ``prompt_token_ids`` and ``outputs[0].token_ids``).

    Raises:
        RuntimeError: a request did not give exactly ``output_len`` tokens.
    """
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    if any(n != output_len for n in lengths):
        raise RuntimeError(f"output lengths {set(lengths)} != {output_len}")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(lengths)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def sync() -> None:
    """Wait for the current CUDA device, when there is one (before reading a clock)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def as_engine_core_process() -> None:
    """Run this process's in-process engine core as the engine core process runs: one
    intra-op CPU thread (``limit_cpu_threads``), and what start-up made frozen out of the
    garbage collector's walks (after the warm-up)."""
    from mm_serve.worker.worker import limit_cpu_threads  # zmq: not for the other benchmarks

    limit_cpu_threads()
    gc.collect()
    gc.freeze()


def free_device_memory() -> None:
    """Collect garbage and give cached CUDA blocks back, so the next model sees the memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated()
        if held > 1 << 30:
            logger.warning("%.1f GiB of CUDA memory still allocated after freeing", held / 2**30)


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        logger.info("Wrote %s", path)


def shutdown(llm: Any) -> None:
    """Stop an ``LLM``'s workers and drop its device memory (call ``del`` on it after)."""
    llm.shutdown()
    llm.engine_core = None
    free_device_memory()
