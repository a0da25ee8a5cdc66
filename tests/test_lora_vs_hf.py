"""Multi-LoRA serving against HF + PEFT on tiny Qwen2-VL and Qwen3-VL checkpoints.

Three adapters made by ``peft`` (ranks 8, 16 with rslora, 64 also on the vision tower and
projector; ``tests.fixtures.lora_adapters``) and the base model run in one batch of text and
image prompts, with chunked prefill (8-token steps, 4-token blocks) and the prefix cache on:
each request's greedy tokens equal HF's ``generate`` on the base model with that adapter
(``PeftModel``). Two slots for three adapters (``max_loras=2``) and a CPU cache of two make the
scheduler hold an adapter back and the worker evict and reload adapters. The same prompts with
the adapters in another order run again: the prefix cache then holds every prompt's blocks,
and still each adapter's tokens are its own (the adapter is in the block hash and, for the
tower adapter, in the image's mm_hash).
"""

from __future__ import annotations

import pytest

from mm_serve import LLM, LoRARequest, SamplingParams
from tests.fixtures.hf_reference import hf_greedy_generate
from tests.fixtures.images import generated, photo
from tests.fixtures.leaks import assert_llm_idle
from tests.fixtures.lora_adapters import build_lora_adapters, hf_with_adapter
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

MAX_NEW_TOKENS = 8
TAG = "<|vision_start|><|image_pad|><|vision_end|>"
CASES = [
    ("A text-only question about nothing in particular.", []),
    (f"{TAG}Describe the image.", [photo("grace_hopper.jpg")]),
    (f"Compare {TAG} with {TAG}.", [generated(120, 60, 1), photo("chelsea.png").convert("L")]),
]
ENGINE_ARGS = dict(
    enable_lora=True,
    max_loras=2,
    max_lora_rank=64,
    max_cpu_loras=2,
    max_num_batched_tokens=8,
    block_size=4,
    enable_prefix_caching=True,
)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def served(request, tmp_path_factory):
    """(base path, {adapter name: LoRARequest}, the engine) of one family."""
    family = request.param
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp(family), family, seed=3)
    folders = build_lora_adapters(path, tmp_path_factory.mktemp(f"{family}_adapters"))
    loras = {
        name: LoRARequest(name, i, folder) for i, (name, folder) in enumerate(folders.items(), 1)
    }
    llm = LLM(path, **ENGINE_ARGS)
    yield path, loras, llm
    llm.shutdown()


def hf_tokens(path: str, adapter_path: str | None) -> list[list[int]]:
    """HF + PEFT's greedy tokens of each of ``CASES``."""
    from transformers import AutoProcessor

    processor, model = AutoProcessor.from_pretrained(path), hf_with_adapter(path, adapter_path)
    tokens = []
    for text, images in CASES:
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        tokens.append(hf_greedy_generate(model, inputs, MAX_NEW_TOKENS)[1])
    return tokens


def run_mixed(llm: LLM, adapters: list[LoRARequest | None]) -> list[list[int]]:
    """Every case with every adapter of ``adapters``, in one ``generate``: the tokens, in the
    order adapter by adapter, case by case."""
    prompts = [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in CASES] * len(adapters)
    per_prompt = [lora for lora in adapters for _ in CASES]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_mixed_adapters_match_hf_peft(served):
    path, loras, llm = served
    adapters = [None, *loras.values()]
    expected = {
        lora: hf_tokens(path, None if lora is None else lora.lora_path) for lora in adapters
    }
    assert len({str(tokens) for tokens in expected.values()}) == len(adapters)  # all differ
    for order in (adapters, adapters[::-1]):  # the second run hits the prefix cache
        tokens = iter(run_mixed(llm, order))
        for lora in order:
            for case, want in zip(CASES, expected[lora], strict=True):
                assert next(tokens) == want, (lora and lora.lora_name, case[0])
    assert llm.get_stats().prefix_cache_hits > 0
    assert_llm_idle(llm)
