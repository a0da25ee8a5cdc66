"""The roofline of the ``bench throughput`` workload: the least time this GPU needs for it.

``roofline(hf_config, workload, rates)`` divides the counted work by the device's measured
rates (``measure_rates``); nothing runs the model. ``mm-serve bench roofline`` prints it:

    mm-serve bench roofline --model-arch qwen2-vl-2b --matmul-tflops 989 --copy-tbps 3.35
    mm-serve bench roofline --result throughput.json --matmul-tflops 989 --copy-tbps 3.35

- Vision tower, per image of ``N = t * h * w`` patches (``smart_resize``), width ``d``: patch
  embedding ``2 N (C T P^2) d``; per block ``2 N 4 d^2`` (qkv, proj) + the MLP (Qwen2-VL:
  ``2 N 2 d r d``, ``r = mlp_ratio``; Qwen2.5-VL SwiGLU: ``2 N 3 d I``) + attention ``4 n^2 d``
  per attended segment of ``n`` patches (Qwen2.5-VL: windows as
  ``encoders/qwen2_5_vl.window_index`` outside ``fullatt_block_indexes``); the merger on
  ``M = N / m^2`` tokens of width ``w = d m^2``: ``2 M w^2 + 2 M w out``. Sources: Qwen2-VL
  (arXiv:2409.12191), Qwen2.5-VL (arXiv:2502.13923) and their HF modeling files.
- LM prefill, per request of ``T`` prompt tokens: ``2 P T`` (``P`` = non-embedding parameters,
  Kaplan et al. 2020, arXiv:2001.08361) + causal attention ``2 T (T + 1) H_q D L`` + the LM
  head on the last prompt token ``2 h V``. Vision and prefill run at the matmul rate.
- Decode: ``output_len - 1`` steps, all requests in one batch. Step ``k`` (context
  ``c = T + k``) reads the weights once (``(P + h V) x dtype bytes``) and every KV cache
  (``c x 2 L H_kv D x dtype bytes``), computes ``2 P + 4 c H_q D L + 2 h V`` FLOPs per request,
  and takes the longer of bytes / copy rate and FLOPs / matmul rate.

Images count one by one, prefill per prompt length; decode is linear in the context, so the
mean prompt is exact. Norms, biases, activations, rotary and sampling are left out (under 1% of
the FLOPs). ``tests/test_bench_roofline.py`` checks the arithmetic by hand."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The published Qwen2-VL / Qwen2.5-VL preprocessor_config.json bounds (pixels).
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # the towers modelled here


@dataclass(frozen=True)
class Rates:
    """What one device does per second: bf16 matmul FLOPs, and copy bytes (read + written)."""

    matmul_flops_per_s: float
    copy_bytes_per_s: float


@dataclass(frozen=True)
class Workload:
    """The throughput workload: ``num_requests`` x (``num_images`` images of ``image_size``
    (width, height) pixels + ``text_tokens`` other prompt tokens) -> ``output_len`` tokens.
    ``text_tokens`` is per request (the prompt minus its image tokens; may be an average).
    ``image_sizes``, if given, is every image's (width, height) instead, request by request
    (photos of varied sizes)."""

    num_requests: int
    image_size: tuple[int, int]
    num_images: int
    text_tokens: float
    output_len: int
    image_sizes: tuple[tuple[int, int], ...] = ()

    def sizes(self) -> list[tuple[int, int]]:
        """Every image's (width, height), request by request."""
        if not self.image_sizes:
            return [self.image_size] * (self.num_requests * self.num_images)
        if len(self.image_sizes) != self.num_requests * self.num_images:
            raise ValueError(
                f"{len(self.image_sizes)} image sizes for {self.num_requests} requests of "
                f"{self.num_images} image(s)."
            )
        return [tuple(size) for size in self.image_sizes]


def measure_rates(
    device: torch.device | str, matmul_size: int = 8192, copy_bytes: int = 1 << 30
) -> Rates:
    """This device's bf16 matmul rate (``matmul_size``^3, ``2 n^3`` FLOPs) and copy bandwidth
    (a ``copy_bytes`` device-to-device copy, counting bytes read + written).

    CUDA: median of ``triton.testing.do_bench`` (warm-up, L2 flushed, CUDA events). CPU: median
    wall time of 5 calls after one warm-up (use small sizes there). Needs ``2 copy_bytes + 3
    matmul_size^2 x 2`` bytes of free memory: call it with the engines gone.
    """
    device = torch.device(device)
    rates = Rates(_matmul_rate(device, matmul_size), copy_rate(device, copy_bytes))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rates


def _matmul_rate(device: torch.device, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)
    return 2 * n**3 / _median_seconds(lambda: torch.matmul(a, b, out=c), device)


def copy_rate(device: torch.device | str, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by an ``nbytes`` device-to-device copy (as
    ``measure_rates`` times it); the ceiling every memory-bound floor of the benchmarks uses."""
    device = torch.device(device)
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()  # read + written
    return moved / _median_seconds(lambda: dst.copy_(src), device)


def _median_seconds(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def image_grid(vision_config: Any, width: int, height: int) -> tuple[int, int, int]:
    """``(t, h, w)`` in patches of one image as the Qwen2-VL image processor resizes it
    (``smart_resize`` into [``MIN_PIXELS``, ``MAX_PIXELS``], sides multiples of patch x merge)."""
    from mm_serve.encoders.qwen2_vl_processor import smart_resize

    patch, merge = vision_config.patch_size, vision_config.spatial_merge_size
    h, w = smart_resize(height, width, patch * merge, MIN_PIXELS, MAX_PIXELS)
    return 1, h // patch, w // patch


def image_tokens(vision_config: Any, width: int, height: int) -> int:
    """LM tokens of one ``width x height`` image (its patches over merge^2)."""
    grid = image_grid(vision_config, width, height)
    return math.prod(grid) // vision_config.spatial_merge_size**2


def _window_sizes(grid: tuple[int, int, int], vision_config: Any) -> list[int]:
    """Patches per attention window of Qwen2.5-VL's windowed blocks, frame by frame."""
    t, h, w = grid
    merge = vision_config.spatial_merge_size
    side = vision_config.window_size // merge // vision_config.patch_size  # in merged tokens
    gh, gw = h // merge, w // merge
    return [
        min(side, gh - y) * min(side, gw - x) * merge * merge
        for _ in range(t)
        for y in range(0, gh, side)
        for x in range(0, gw, side)
    ]


def vision_flops(hf_config: Any, grid: tuple[int, int, int]) -> float:
    """Matmul FLOPs of one image of ``grid`` patches through the tower (see the module doc).

    Raises ``ValueError`` for a model type other than qwen2_vl / qwen2_5_vl."""
    vc, model_type = hf_config.vision_config, hf_config.model_type
    n = math.prod(grid)
    patch_dim = 3 * vc.temporal_patch_size * vc.patch_size**2
    if model_type == "qwen2_vl":
        d, out = vc.embed_dim, vc.hidden_size
        mlp = 2 * n * 2 * d * int(d * vc.mlp_ratio)
        attention = [4 * n * n * d] * vc.depth
    elif model_type == "qwen2_5_vl":
        d, out = vc.hidden_size, vc.out_hidden_size
        mlp = 2 * n * 3 * d * vc.intermediate_size
        windowed = sum(4 * s * s * d for s in _window_sizes(grid, vc))
        full = set(vc.fullatt_block_indexes)
        attention = [4 * n * n * d if i in full else windowed for i in range(vc.depth)]
    else:
        raise ValueError(f"No roofline for model type {model_type!r}: {MODEL_TYPES}.")
    merged, width = n // vc.spatial_merge_size**2, d * vc.spatial_merge_size**2
    merger = 2 * merged * width * width + 2 * merged * width * out
    return 2 * n * patch_dim * d + vc.depth * (2 * n * 4 * d * d + mlp) + sum(attention) + merger


@dataclass(frozen=True)
class LMShape:
    """The language model's sizes: ``params`` non-embedding parameters (attention + MLP
    matrices of all layers), ``head_params = hidden x vocab`` (the LM head)."""

    params: int
    head_params: int
    layers: int
    q_width: int  # query heads x head dim
    kv_width: int  # KV heads x head dim

    @classmethod
    def from_config(cls, text_config: Any) -> LMShape:
        tc = text_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        q, kv = tc.num_attention_heads * head_dim, tc.num_key_value_heads * head_dim
        h = tc.hidden_size
        per_layer = 2 * h * q + 2 * h * kv + 3 * h * tc.intermediate_size
        layers = tc.num_hidden_layers
        return cls(per_layer * layers, h * tc.vocab_size, layers, q, kv)

    def prefill_flops(self, prompt_len: float) -> float:
        """One request's prefill of ``prompt_len`` tokens, its first output token's head."""
        t = prompt_len
        attention = 2 * t * (t + 1) * self.q_width * self.layers
        return 2 * self.params * t + attention + 2 * self.head_params

    def decode_flops(self, context: float) -> float:
        """One request's decode step at ``context`` tokens (the new one included)."""
        return 2 * self.params + 4 * context * self.q_width * self.layers + 2 * self.head_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_width * dtype_bytes


def roofline(
    hf_config: Any, workload: Workload, rates: Rates, dtype_bytes: int = 2
) -> dict[str, Any]:
    """The workload's least time on a device of ``rates`` (formula: the module docstring).

    Returns the counts (``image_tokens`` per image, ``prompt_tokens`` per request,
    ``vision_flops``, ``prefill_flops``, ``decode_flops``, ``decode_bytes``: totals), the time
    of each phase (``vision_s``, ``prefill_s``, ``decode_s``), ``total_s`` and
    ``output_tokens_per_s``. Raises ``ValueError`` for a model type it does not model.
    """
    if hf_config.model_type not in MODEL_TYPES:
        raise ValueError(f"No roofline for model type {hf_config.model_type!r}: {MODEL_TYPES}.")
    w, vc = workload, hf_config.vision_config
    sizes = w.sizes()
    grids = {size: image_grid(vc, *size) for size in set(sizes)}
    flops = {size: vision_flops(hf_config, grid) for size, grid in grids.items()}
    tokens = [math.prod(grids[size]) // vc.spatial_merge_size**2 for size in sizes]
    per_request = [  # prompt tokens of each request
        w.text_tokens + sum(tokens[i * w.num_images : (i + 1) * w.num_images])
        for i in range(w.num_requests)
    ]
    prompt_len = sum(per_request) / w.num_requests  # decode is linear in it: the mean is exact
    lm = LMShape.from_config(hf_config.text_config)
    vision = sum(flops[size] for size in sizes)
    prefill = sum(lm.prefill_flops(t) for t in per_request)
    weight_bytes = (lm.params + lm.head_params) * dtype_bytes
    decode_s = decode_flops = decode_bytes = 0.0
    for k in range(1, w.output_len):
        context = prompt_len + k
        step_bytes = weight_bytes + w.num_requests * context * lm.kv_bytes_per_token(dtype_bytes)
        step_flops = w.num_requests * lm.decode_flops(context)
        decode_bytes += step_bytes
        decode_flops += step_flops
        decode_s += max(step_bytes / rates.copy_bytes_per_s, step_flops / rates.matmul_flops_per_s)
    vision_s, prefill_s = vision / rates.matmul_flops_per_s, prefill / rates.matmul_flops_per_s
    total_s = vision_s + prefill_s + decode_s
    return {
        "image_tokens": sum(tokens) / len(tokens) if tokens else 0,
        "prompt_tokens": prompt_len,
        "vision_flops": vision,
        "prefill_flops": prefill,
        "decode_flops": decode_flops,
        "decode_bytes": decode_bytes,
        "vision_s": vision_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total_s,
        "output_tokens_per_s": w.num_requests * w.output_len / total_s,
    }


def result_roofline(hf_config: Any, result: dict[str, Any], rates: Rates) -> dict[str, Any]:
    """The roofline of a ``bench throughput`` ``result`` on a device of ``rates``: the workload
    from its ``workload`` and the ``mm_serve`` run's prompt tokens (the text tokens are what
    the images leave of them), with the rates, the workload and each engine's percentage of
    the roofline (``percent_of_roofline``).

    Raises:
        ValueError: a model type it does not model, or image sizes that do not fit the run.
    """
    spec, ours = result["workload"], result["mm_serve"]
    sizes = tuple(tuple(size) for size in spec.get("image_sizes") or ())
    workload = Workload(ours["num_requests"], tuple(spec["image_size"]), spec["num_images"],
                        0, spec["output_len"], sizes)  # fmt: skip
    if hf_config.model_type not in MODEL_TYPES:
        raise ValueError(f"No roofline for model type {hf_config.model_type!r}: {MODEL_TYPES}.")
    image_tokens_all = sum(image_tokens(hf_config.vision_config, *s) for s in workload.sizes())
    text_tokens = (ours["prompt_tokens"] - image_tokens_all) / ours["num_requests"]
    workload = dataclasses.replace(workload, text_tokens=text_tokens)
    out = roofline(hf_config, workload, rates)
    out.update(dataclasses.asdict(rates), workload=dataclasses.asdict(workload))
    out["percent_of_roofline"] = {
        name: 100 * result[name]["output_tokens_per_s"] / out["output_tokens_per_s"]
        for name in ("mm_serve", "mm_serve_prefix_caching_off", "vllm")
        if result.get(name)
    }
    return out


def bench_roofline(hf_config: Any, result: dict[str, Any], device: torch.device) -> dict | None:
    """``bench throughput``'s roofline (``result_roofline``) at rates measured now on
    ``device``. None on CPU or for a model type it does not model (logged)."""
    if device.type != "cuda":
        logger.info("Roofline skipped: it needs a CUDA device's rates.")
        return None
    if hf_config.model_type not in MODEL_TYPES:
        logger.warning("Roofline skipped: no roofline for model type %r.", hf_config.model_type)
        return None
    return result_roofline(hf_config, result, measure_rates(device))


def print_roofline(roof: dict[str, Any] | None) -> None:
    """The roofline's lines of the summary table."""
    if roof is None:
        print("roofline: none (CUDA only; Qwen2-VL and Qwen2.5-VL)")
        return
    print(
        f"roofline: {roof['output_tokens_per_s']:,.0f} out tok/s in {roof['total_s']:.3f} s at "
        f"{roof['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s (bf16 matmul) and "
        f"{roof['copy_bytes_per_s'] / 1e12:.2f} TB/s (copy, read + write), "
        f"{'measured now' if roof.get('rates_measured', True) else 'as given'}"
    )
    print(f"  vision {roof['vision_flops'] / 1e12:,.1f} TFLOP ({roof['vision_s']:.3f} s), "
          f"prefill {roof['prefill_flops'] / 1e12:,.1f} TFLOP ({roof['prefill_s']:.3f} s), "
          f"decode {roof['decode_bytes'] / 1e9:,.0f} GB ({roof['decode_s']:.3f} s); "
          f"{roof['prompt_tokens']:.0f} prompt tokens per request")  # fmt: skip
    for name, percent in roof["percent_of_roofline"].items():
        print(f"  {name}: {percent:.1f}% of the roofline")


# ---------------------------------------------------------------- mm-serve bench roofline


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mm-serve bench roofline``."""
    from mm_serve.benchmarks.architectures import architecture_names

    group = parser.add_argument_group("model (default: --result's model, else qwen2-vl-2b)")
    group.add_argument("--model", help="A checkpoint folder or hub id (its config.json).")
    group.add_argument("--model-arch", choices=architecture_names(), help="A published one.")
    group = parser.add_argument_group("workload (or --result)")
    group.add_argument("--num-prompts", type=int, default=256, help="Requests, one batch.")
    group.add_argument("--image-size", type=int, nargs=2, default=[448, 448],
                       metavar=("WIDTH", "HEIGHT"))  # fmt: skip
    group.add_argument("--num-images", type=int, default=1, help="Images per request.")
    group.add_argument("--text-tokens", type=float, default=50.0,
                       help="Prompt tokens per request besides the image tokens.")  # fmt: skip
    group.add_argument("--output-len", type=int, default=128, help="Output tokens per request.")
    group.add_argument(
        "--result",
        metavar="PATH",
        help="A `bench throughput --output-json` file: its workload (images of varied sizes "
        "included; text tokens from its prompt tokens) and each engine's share of the roofline.",
    )
    group = parser.add_argument_group("device (rates measured on --device unless given)")
    group.add_argument("--matmul-tflops", type=float, help="bf16 matmul TFLOP/s.")
    group.add_argument("--copy-tbps", type=float, help="Copy TB/s (bytes read + written).")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    group.add_argument("--device", default=default_device, help="Default: %(default)s.")
    parser.add_argument("--output-json", metavar="PATH", help="Write the roofline here.")


def _hf_config(args: argparse.Namespace, result: dict[str, Any] | None) -> Any:
    """The transformers config of ``--model``, ``--model-arch`` or the result's model."""
    import tempfile

    from transformers import AutoConfig

    from mm_serve.benchmarks.architectures import architecture_names, write_architecture

    name = args.model or args.model_arch or (result or {}).get("model") or "qwen2-vl-2b"
    if args.model or name not in architecture_names():
        return AutoConfig.from_pretrained(name)
    with tempfile.TemporaryDirectory(prefix="mm-serve-roofline-") as folder:
        return AutoConfig.from_pretrained(write_architecture(name, folder))


def _rates(args: argparse.Namespace) -> Rates:
    """``--matmul-tflops`` and ``--copy-tbps``; what is not given, measured on ``--device``
    (small sizes on a CPU)."""
    given = Rates((args.matmul_tflops or 0) * 1e12, (args.copy_tbps or 0) * 1e12)
    if args.matmul_tflops and args.copy_tbps:
        return given
    device = torch.device(args.device)
    sizes = {} if device.type == "cuda" else {"matmul_size": 512, "copy_bytes": 1 << 26}
    measured = measure_rates(device, **sizes)
    return Rates(given.matmul_flops_per_s or measured.matmul_flops_per_s,
                 given.copy_bytes_per_s or measured.copy_bytes_per_s)  # fmt: skip


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Print the roofline of the workload (the flags' or ``--result``'s) and write it to
    ``--output-json``: ``roofline``'s counts and times, the rates, the workload and, with
    ``--result``, each engine's ``percent_of_roofline``; returns it.

    Raises:
        SystemExit: ``error: ...`` for a model type it does not model or image sizes that do
            not fit the result's requests.
    """
    result = None
    if args.result:
        with open(args.result) as f:
            result = json.load(f)
    hf_config = _hf_config(args, result)
    rates = _rates(args)
    try:
        if result is not None:
            out = result_roofline(hf_config, result, rates)
        else:
            workload = Workload(args.num_prompts, tuple(args.image_size), args.num_images,
                                args.text_tokens, args.output_len)  # fmt: skip
            out = roofline(hf_config, workload, rates)
            out.update(dataclasses.asdict(rates), workload=dataclasses.asdict(workload))
            out["percent_of_roofline"] = {}
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    out["rates_measured"] = not (args.matmul_tflops and args.copy_tbps)
    print_roofline(out)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)
    return out
