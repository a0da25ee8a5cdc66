"""What each multimodal cache saves on a repeated-image workload (offline ``LLM``, CPU is fine).

    python -m mm_serve.benchmarks.mm_caches [--model PATH] [--rounds 4] [--max-tokens 16]

The workload: four real photographs, upscaled to 1920x1080 and sent as JPEG bytes (what a chat
upload looks like), asked about in ``--rounds`` successive batches with a new question each
round (a chat-about-my-photo pattern: the same images come back). Every configuration runs the
same rounds in a fresh engine (after one warm-up call on an unrelated image) and prints the wall
time, the work done, and the time each cache saves (its run with that cache off minus the run
with all on):

- processor cache (``mm_processor_cache_gb``): a repeated image skips decoding and resizing;
- encoder cache (``encoder_cache_size``): a repeated image skips the vision encoder; "off"
  here means the smallest allowed cache, one image;
- prefix cache (``enable_prefix_caching``): a repeated image (and any shared text before it)
  skips the LM prefill of its blocks.

Without ``--model`` it builds a tiny random-weight Qwen2-VL checkpoint (no download).
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.testing.vlm_checkpoints import build_tiny_vlm_checkpoint

QUESTIONS = [
    "Describe the image.",
    "What is in the picture?",
    "Write a caption.",
    "What colours do you see?",
    "Is there a person?",
    "Where was this taken?",
    "Count the objects.",
    "What stands out?",
]


def photos() -> list[bytes]:
    """Real photographs shipped with matplotlib and scikit-image (test extras), as 1080p JPEGs."""
    import matplotlib
    import skimage

    sk = Path(skimage.__file__).parent / "data"
    paths = [Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"]
    paths += [sk / name for name in ("astronaut.png", "coffee.png", "chelsea.png")]
    encoded = []
    for path in paths:
        buffer = io.BytesIO()
        Image.open(path).convert("RGB").resize((1920, 1080)).save(buffer, "JPEG", quality=90)
        encoded.append(buffer.getvalue())
    return encoded


def workload(rounds: int) -> list[list[dict]]:
    """``rounds`` batches, each asking one new question about every photo."""
    tag = "<|vision_start|><|image_pad|><|vision_end|>"
    images = photos()
    return [
        [
            {"prompt": f"{tag}{QUESTIONS[r % len(QUESTIONS)]}", "multi_modal_data": {"image": [i]}}
            for i in images
        ]
        for r in range(rounds)
    ]


CONFIGS = {
    "all caches on": {},
    "processor cache off": {"mm_processor_cache_gb": 0},
    "encoder cache off": {"encoder_cache_size": "min"},
    "prefix cache off": {"enable_prefix_caching": False},
    "all caches off": {
        "mm_processor_cache_gb": 0,
        "encoder_cache_size": "min",
        "enable_prefix_caching": False,
    },
}


def counters(llm: LLM) -> dict[str, int]:
    stats = llm.get_stats()
    return {
        "encoder tok": stats.encoder_tokens_computed,
        "prefix hit tok": stats.prefix_cache_hits,
        "processor hits": stats.processor_cache_hits,
    }


def run_config(model: str, overrides: dict, rounds: list, max_tokens: int, trials: int):
    """Median wall time of ``trials`` fresh engines over the ``rounds`` (one ``generate`` call
    each) and the last run's counters (the warm-up call excluded)."""
    times, work = [], {}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warmup = {
        "prompt": rounds[0][0]["prompt"],
        "multi_modal_data": {"image": [Image.new("RGB", (64, 64), "white")]},
    }
    for _ in range(trials):
        args = dict(overrides)
        if args.get("encoder_cache_size") == "min":
            args["encoder_cache_size"] = LLM(model).config.multimodal.max_image_tokens
        llm = LLM(model, **args)
        llm.generate([warmup], params, use_tqdm=False)  # starts the pool, warms the kernels
        before = counters(llm)
        start = time.perf_counter()
        for prompts in rounds:
            llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        work = {k: v - before[k] for k, v in counters(llm).items()}
        llm.shutdown()
    return statistics.median(times), work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Qwen2-VL checkpoint (default: tiny, built here)")
    parser.add_argument("--rounds", type=int, default=4, help="batches asking about every photo")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--trials", type=int, default=3, help="fresh engines per configuration")
    args = parser.parse_args()
    model = args.model or build_tiny_vlm_checkpoint(tempfile.mkdtemp(), family="qwen2_vl")
    rounds = workload(args.rounds)
    print(f"{args.rounds} rounds of {len(rounds[0])} requests, {args.max_tokens} output tokens")
    results = {
        name: run_config(model, overrides, rounds, args.max_tokens, args.trials)
        for name, overrides in CONFIGS.items()
    }
    names = list(next(iter(results.values()))[1])
    print(f"{'configuration':<20} {'time s':>7} " + " ".join(f"{n:>14}" for n in names))
    for name, (seconds, work) in results.items():
        print(f"{name:<20} {seconds:>7.3f} " + " ".join(f"{work[n]:>14}" for n in names))
    all_on = results["all caches on"][0]
    for cache in ("processor", "encoder", "prefix"):
        off = results[f"{cache} cache off"][0]
        print(f"{cache} cache saves {off - all_on:.3f} s ({(off - all_on) / off:.0%} of the run)")
    all_off = results["all caches off"][0]
    print(f"all caches save {all_off - all_on:.3f} s ({(all_off - all_on) / all_off:.0%})")


if __name__ == "__main__":
    main()
