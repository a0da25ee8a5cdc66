"""The offline LLM against HF transformers on the same checkpoint: greedy tokens and logprobs.

Each scenario pushes the engine through a different path (chunked prefill, preemption,
prefix caching on and off, shared prefixes) and must give exactly HF's greedy tokens.
"""

from __future__ import annotations

import random

import pytest

from mm_serve import LLM, SamplingParams
from tests.fixtures.leaks import assert_llm_idle

MAX_NEW_TOKENS = 20
PROMPT_LENGTHS = [3, 70, 5, 8, 47, 12, 15, 16, 17, 20, 24, 31, 33, 40, 55, 64]
LOGPROB_TOL = 1e-4


def random_prompts(vocab_size: int, lengths: list[int], seed: int, prefix: list[int] = ()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def assert_no_kv_leak(llm: LLM) -> None:
    assert_llm_idle(llm)


def assert_logprobs_match(step_logprobs: dict, reference) -> None:
    """Every reported logprob equals HF's; HF's top-5 are reported (up to exact near-ties)."""
    for token_id, logprob in step_logprobs.items():
        assert abs(logprob.logprob - reference[token_id].item()) < LOGPROB_TOL
    top_values, top_ids = reference.topk(5)
    for value, token_id in zip(top_values.tolist(), top_ids.tolist(), strict=True):
        if token_id not in step_logprobs:
            assert value - top_values[-1].item() < LOGPROB_TOL  # a tie at the 5th place
    ranks = sorted(lp.rank for lp in step_logprobs.values())
    assert ranks[:5] == [1, 2, 3, 4, 5] or ranks[:6] == [1, 1, 2, 3, 4, 5]


def check_against_hf(llm: LLM, reference, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        completion = output.outputs[0]
        ref_tokens, ref_logprobs = reference.greedy(prompt, MAX_NEW_TOKENS)
        assert completion.token_ids == ref_tokens
        assert len(completion.logprobs) == len(ref_tokens)
        for step, step_logprobs in enumerate(completion.logprobs):
            assert_logprobs_match(step_logprobs, ref_logprobs[step])
    assert_no_kv_leak(llm)


SCENARIOS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 24},
    "preemption": {"block_size": 4, "num_kv_blocks": 32},
    "chunked_and_preemption": {"max_num_batched_tokens": 20, "block_size": 4, "num_kv_blocks": 32},
    "no_prefix_caching": {"enable_prefix_caching": False, "max_num_batched_tokens": 32},
    # The next step is scheduled before the last one's tokens are read (on by default on GPU).
    "async_scheduling": {"async_scheduling": True},
    "async_chunked_and_preemption": {
        "async_scheduling": True,
        "max_num_batched_tokens": 20,
        "block_size": 4,
        "num_kv_blocks": 32,
    },
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_matches_hf(model_path, hf_reference, scenario):
    llm = LLM(model_path, **SCENARIOS[scenario])
    prompts = random_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS, seed=7)
    check_against_hf(llm, hf_reference(model_path), prompts)
    if "preemption" in scenario:
        assert llm.get_stats().num_preemptions > 0


@pytest.mark.parametrize("caching", [True, False])
def test_shared_prefixes_match_hf(model_path, hf_reference, caching):
    llm = LLM(model_path, enable_prefix_caching=caching, block_size=4)
    vocab = llm.config.model.vocab_size
    prefix = random_prompts(vocab, [37], seed=3)[0]
    prompts = random_prompts(vocab, PROMPT_LENGTHS, seed=11, prefix=prefix)
    check_against_hf(llm, hf_reference(model_path), prompts[:8])
    # A second batch with the same prefix is served from the prefix cache.
    hits_before = llm.get_stats().prefix_cache_hits
    check_against_hf(llm, hf_reference(model_path), prompts[8:])
    hits = llm.get_stats().prefix_cache_hits - hits_before
    if caching:
        assert hits >= 8 * (len(prefix) // 4) * 4
    else:
        assert hits == 0


def test_prompt_logprobs_match_hf(llama_path, hf_reference):
    llm = LLM(llama_path, max_num_batched_tokens=16)
    prompts = random_prompts(llm.config.model.vocab_size, [40, 9, 23], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_reference(llama_path).prompt_logprobs(prompt)
        assert output.prompt_logprobs[0] is None
        assert len(output.prompt_logprobs) == len(prompt)
        for position, step_logprobs in enumerate(output.prompt_logprobs[1:]):
            assert prompt[position + 1] in step_logprobs
            for token_id, logprob in step_logprobs.items():
                assert abs(logprob.logprob - reference[position, token_id].item()) < LOGPROB_TOL
    assert_no_kv_leak(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_repetition_penalty_matches_hf(qwen2_path, hf_reference, async_scheduling):
    llm = LLM(qwen2_path, async_scheduling=async_scheduling)
    prompts = random_prompts(llm.config.model.vocab_size, [6, 19, 30], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ref_tokens, _ = hf_reference(qwen2_path).greedy(prompt, 16, repetition_penalty=1.8)
        assert output.outputs[0].token_ids == ref_tokens
    assert_no_kv_leak(llm)
