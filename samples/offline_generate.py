"""Offline generation with the LLM API.

Without arguments it generates from the bundled demo VLM (``samples/demo_vlm/model``: small,
trained on generated scenes, no download needed), so the whole engine runs on any CPU:
loading, paged KV cache, chunked prefill, prefix caching, sampling, detokenization. Run it
with the project's environment (``make`` creates ``.venv``):

    .venv/bin/python samples/offline_generate.py                 # or: make demo
    .venv/bin/python samples/offline_generate.py /path/to/model  # any supported HF checkpoint
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mm_serve import LLM, SamplingParams

DEMO_MODEL = Path(__file__).resolve().parent / "demo_vlm" / "model"


def main() -> None:
    generate(sys.argv[1] if len(sys.argv) > 1 else str(DEMO_MODEL))


def generate(model: str) -> None:
    """Sample four prompts, then one greedy chat turn, and print them."""
    llm = LLM(model)
    prompts = [
        "The capital of France is",
        "A short poem about the sea:",
        "def fibonacci(n):",
        "In a distant galaxy",
    ]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=32)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for output in outputs:
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{num_tokens} tokens in {elapsed:.2f} s")
    (reply,) = llm.chat(
        [{"role": "user", "content": "Tell me about yourself."}],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    print(f"chat -> {reply.outputs[0].text!r}")
    llm.shutdown()


if __name__ == "__main__":
    main()
