"""Offline throughput, like ``vllm bench throughput``: all requests at once through ``LLM``.

The workload: ``--num-prompts`` requests (``datasets.random_image_dataset``) of ``--input-len``
random words and ``--num-images`` noise images of ``--image-size`` (or up to
``--max-image-size``), each forced to exactly ``--output-len`` tokens (greedy, ignore EOS). Raw
text prompts (no chat template), so the prefix cache must get no hits (checked).

The clock covers ``LLM.generate`` on all requests (preprocessing included), after the engine is
built and warmed up on other requests. Unless ``--no-hf``, HF ``generate`` runs first on the
same requests at ``--hf-batch-sizes``. ``--compare-prefix-caching`` reruns with prefix caching
off; ``--compare-structured-outputs`` reruns with ``LONG_SCHEMA`` on every output (no request can
complete it, so each still gives ``--output-len`` tokens). ``--peer vllm`` runs vLLM on the same
requests in a subprocess (``peer_vllm``). On CUDA each engine is reported as a share of the
roofline (``roofline``) at rates measured after the engines are gone.

    python -m mm_serve.benchmarks.throughput --model-arch qwen2-vl-2b --num-prompts 256 \
        --compare-prefix-caching --output-json throughput.json"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from typing import Any

from mm_serve.benchmarks import common, peer_vllm, roofline
from mm_serve.benchmarks.datasets import BenchRequest

logger = logging.getLogger(__name__)

NUM_WARMUP_REQUESTS = 4
LONG_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "value": {"type": "integer"}},
        "required": ["name", "value"],
    },
    "minItems": 1000,
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mm-serve bench throughput``."""
    common.add_model_args(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=256)
    group.add_argument("--input-len", type=int, default=50, help="Random words per prompt.")
    group.add_argument("--output-len", type=int, default=128, help="Output tokens per request.")
    common.add_image_args(parser)
    common.add_varied_size_arg(parser)
    group = parser.add_argument_group("comparisons and output")
    group.add_argument(
        "--hf-batch-sizes",
        type=int,
        nargs="+",
        default=[16, 32, 64, 128],
        help="Batch sizes of the HF transformers baseline (default: %(default)s).",
    )
    group.add_argument(
        "--hf-num-batches", type=int, default=1, help="Batches timed per HF batch size."
    )
    group.add_argument("--no-hf", action="store_true", help="Skip the HF baseline.")
    group.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="Also run the engine with prefix caching off and report on/off.",
    )
    group.add_argument(
        "--compare-structured-outputs",
        action="store_true",
        help="Also run the engine with a JSON schema on every request and report with/without.",
    )
    group.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Engine runs per configuration (fresh engines, alternating); the best is reported.",
    )
    group.add_argument("--output-json", help="Write the full results here.")
    peer_vllm.add_cli_args(parser)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"bench throughput: {message}")


def run_engine(
    folder: str,
    engine_kwargs: dict[str, Any],
    requests: list[BenchRequest],
    texts: list[str],
    warmup: list[BenchRequest],
    warmup_texts: list[str],
    structured: bool = False,
) -> dict[str, Any]:
    """Build an ``LLM``, warm it up, time ``generate`` on all requests; frees it after.
    ``structured``: every request's output is constrained by ``LONG_SCHEMA``.

    Returns requests/s, output and total tok/s, token counts and the prefix-cache counters of
    the timed call. Raises ``RuntimeError`` if a request did not give exactly its
    ``output_len`` tokens or the prefix cache hit.
    """
    from mm_serve import LLM, SamplingParams
    from mm_serve.messages.structured_outputs import StructuredOutputsParams

    output_len = requests[0].output_len
    constraint = StructuredOutputsParams(json=json.dumps(LONG_SCHEMA)) if structured else None
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=constraint
    )
    llm = LLM(folder, **engine_kwargs)
    try:
        llm.generate(common.llm_prompts(warmup, warmup_texts), params, use_tqdm=False)
        before = llm.get_stats()
        prompts = common.llm_prompts(requests, texts)
        common.sync()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        common.sync()
        elapsed = time.perf_counter() - start
        after = llm.get_stats()
    finally:
        common.shutdown(llm)
        del llm
        common.free_device_memory()
    figures = common.run_figures(outputs, elapsed, output_len)
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    _check(hits == 0, f"{hits} prefix-cache hit tokens; the workload must have none")
    return {
        "enable_prefix_caching": engine_kwargs["enable_prefix_caching"],
        "structured_outputs": structured,
        **figures,
        "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
        "prefix_cache_hits": hits,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the results (also written to ``--output-json``)."""
    from mm_serve.config import EngineArgs

    if args.max_image_size and args.peer_bench:
        raise ValueError("--peer-bench sends vLLM's random-mm images of one size.")
    dataset = common.args_dataset(args, args.num_prompts + NUM_WARMUP_REQUESTS, args.seed)
    requests, warmup = dataset[NUM_WARMUP_REQUESTS:], dataset[:NUM_WARMUP_REQUESTS]
    with tempfile.TemporaryDirectory(prefix="mm-serve-bench-") as workdir:
        folder, load_format = common.model_folder(args, workdir)
        kwargs = common.engine_kwargs(args, load_format)
        # Resolved as the engine will (dtype, device, folder), without loading weights.
        engine_fields = {k: v for k, v in kwargs.items() if k != "multiprocess"}
        config = EngineArgs(model=folder, **engine_fields).create_engine_config()
        folder, model_type = config.model.path, config.model.hf_config.model_type
        texts = common.prompt_texts(requests, model_type)
        warmup_texts = common.prompt_texts(warmup, model_type)
        result = common.result_header(args, load_format, config, _workload(args, requests))
        result["hf"] = None
        if not args.no_hf:
            result["hf"] = _run_hf(args, folder, requests, texts, config)
        configs = _configurations(args, load_format, kwargs)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        peer = None
        if args.peer:  # the same requests, written once for the peer's subprocesses
            workload = peer_vllm.PeerWorkload(requests, texts, warmup, warmup_texts)
            peer = peer_vllm.PeerRunner(args, folder, load_format, workdir, workload)
            runs["vllm"] = []
        for _ in range(args.repeats):  # configurations alternate: neither always goes first
            for name, engine_kwargs in configs.items():
                structured = name == "mm_serve_json_schema"
                runs[name].append(
                    run_engine(
                        folder, engine_kwargs, requests, texts, warmup, warmup_texts, structured
                    )
                )
            if peer:
                runs["vllm"].append(peer.run(runs["mm_serve"][-1]["prompt_tokens"]))
        _keep_best_runs(result, runs)
        if peer and args.peer_bench:
            vision_config = config.model.hf_config.vision_config
            tokens = roofline.image_tokens(vision_config, *args.image_size)
            result["vllm_bench"] = peer.bench(result["mm_serve"]["prompt_tokens"], tokens)
    result["roofline"] = roofline.bench_roofline(config.model.hf_config, result, config.device)
    _add_ratios(result)
    print_summary(result)
    common.write_json(args.output_json, result)
    return result


def _configurations(args, load_format: str, kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The engine kwargs of each configuration run: ``mm_serve``, and those compared with it."""
    configs = {"mm_serve": kwargs}
    if args.compare_prefix_caching:
        configs["mm_serve_prefix_caching_off"] = common.engine_kwargs(
            args, load_format, enable_prefix_caching=False
        )
    if args.compare_structured_outputs:
        configs["mm_serve_json_schema"] = kwargs
    return configs


def _workload(args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    """The workload's fields; with ``--max-image-size``, every image's (width, height) too."""
    workload = {"num_prompts": args.num_prompts, **common.image_workload(args)}
    if args.max_image_size:
        workload["max_image_size"] = list(args.max_image_size)
        workload["image_sizes"] = [list(image.size) for r in requests for image in r.images]
    return workload


def _keep_best_runs(result: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> None:
    """``result[name]``: each configuration's best run, with every run's output tok/s."""
    for name, results in runs.items():
        result[name] = max(results, key=lambda r: r["output_tokens_per_s"])
        result[name]["all_runs_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in results]


def _run_hf(args, folder, requests, texts, config) -> dict[str, Any]:
    """The HF baseline on the same requests (see ``hf_baseline``), in the engine's dtype."""
    from mm_serve.benchmarks.hf_baseline import run_hf_baseline

    return run_hf_baseline(
        folder, requests, texts, args.hf_batch_sizes, args.output_len,
        dtype=config.model.dtype, device=config.device, seed=args.seed,
        num_batches=args.hf_num_batches,
    )  # fmt: skip


def _add_ratios(result: dict[str, Any]) -> None:
    ours = result["mm_serve"]["output_tokens_per_s"]
    off = result.get("mm_serve_prefix_caching_off")
    if off:
        result["prefix_caching_on_over_off"] = ours / off["output_tokens_per_s"]
    schema = result.get("mm_serve_json_schema")
    if schema:
        result["json_schema_over_none"] = schema["output_tokens_per_s"] / ours
    if result.get("vllm"):
        result["mm_serve_over_vllm"] = ours / result["vllm"]["output_tokens_per_s"]
    best = (result["hf"] or {}).get("best")
    if best:
        result["mm_serve_over_hf_best"] = ours / best["output_tokens_per_s"]


def _sizes(workload: dict[str, Any]) -> str:
    """``WxH``, or ``WxH-WxH`` for images of varied sizes."""
    low = "x".join(map(str, workload["image_size"]))
    high = workload.get("max_image_size")
    return f"{low}-{high[0]}x{high[1]}" if high else low


def print_summary(result: dict[str, Any]) -> None:
    """The short table, last on stdout."""
    w = result["workload"]
    print(f"\n{result['model']} ({result['load_format']} weights, {result['dtype']}) on "
          f"{result['device']}: {w['num_prompts']} requests, {w['input_len_words']} words + "
          f"{w['num_images']} x {_sizes(w)} image(s) -> "
          f"{w['output_len']} tokens")  # fmt: skip
    print(f"{'run':<28} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'prompt tok':>11}")
    runs = (("mm_serve", "mm_serve"), ("mm_serve_prefix_caching_off", "  prefix caching off"),
            ("mm_serve_json_schema", "  JSON schema on every request"),
            ("vllm", f"vLLM {result.get('vllm', {}).get('vllm_version', '')}"))  # fmt: skip
    for key, label in runs:
        r = result.get(key)
        if r:
            print(f"{label:<28} {r['requests_per_s']:>8.2f} {r['output_tokens_per_s']:>10.1f} "
                  f"{r['total_tokens_per_s']:>12.1f} {r['prompt_tokens']:>11}")  # fmt: skip
    for row in (result["hf"] or {}).get("batches", []):
        label = f"HF generate, batch {row['batch_size']}"
        figure = row["error"][:40] if row["error"] else f"{row['output_tokens_per_s']:>10.1f}"
        print(f"{label:<28} {'':>8} {figure:>10}")
    if "prefix_caching_on_over_off" in result:
        print(f"prefix caching on / off: {result['prefix_caching_on_over_off']:.3f}x")
    if "json_schema_over_none" in result:
        print(f"JSON schema / none: {result['json_schema_over_none']:.3f}x")
    if "mm_serve_over_hf_best" in result:
        best = result["hf"]["best"]["batch_size"]
        print(f"mm_serve / HF best (batch {best}): {result['mm_serve_over_hf_best']:.2f}x")
    if "mm_serve_over_vllm" in result:
        print(f"mm_serve / vLLM (same requests): {result['mm_serve_over_vllm']:.3f}x")
    if result.get("vllm_bench"):
        print(f"vLLM's own bench throughput (random-mm, same shapes): "
              f"{result['vllm_bench']['output_tokens_per_s']:.1f} out tok/s")  # fmt: skip
    roofline.print_roofline(result.get("roofline"))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args())
