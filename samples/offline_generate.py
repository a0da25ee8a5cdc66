"""Offline generation with the LLM API.

Without arguments it builds a tiny random-weight Qwen2 checkpoint in a temporary folder (no
download needed; removed at the end) and generates from it, so the output is gibberish but the
whole engine runs: loading, paged KV cache, chunked prefill, prefix caching, sampling,
detokenization. Run it with the project's environment (``make`` creates ``.venv``):

    .venv/bin/python samples/offline_generate.py                 # or: make demo
    .venv/bin/python samples/offline_generate.py /path/to/model  # any supported HF checkpoint
"""

from __future__ import annotations

import sys
import tempfile
import time

from mm_serve import LLM, SamplingParams
from mm_serve.testing.checkpoints import build_tiny_checkpoint


def main() -> None:
    if len(sys.argv) > 1:
        generate(sys.argv[1])
        return
    with tempfile.TemporaryDirectory(prefix="mm_serve_tiny_") as folder:
        model = build_tiny_checkpoint(folder, family="qwen2")
        print(f"Built a tiny random-weight checkpoint in {model}")
        generate(model)


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
