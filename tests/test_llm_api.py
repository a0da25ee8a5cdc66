"""The offline API's behaviour: seeded sampling, stop strings, n > 1, chat, errors, no leaks."""

from __future__ import annotations

import pytest

from mm_serve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_path) -> LLM:
    return LLM(llama_path, block_size=4, multiprocess=False)


def assert_no_kv_leak(llm: LLM) -> None:
    kv = llm.engine_core.scheduler.kv_cache_manager
    assert not llm.engine_core.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_seeded_sampling_reproducible_across_runs_and_batches(llm, llama_path):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=13, ignore_eos=True)
    prompt = "The quick brown fox"
    alone = token_ids(llm.generate(prompt, seeded, use_tqdm=False))
    batch = llm.generate(
        ["Hello there", prompt, "Once upon a time", prompt],
        [other, seeded, other, SamplingParams(temperature=1.0, seed=99, max_tokens=20)],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone[0]
    assert batch[3].outputs[0].token_ids != alone[0]  # another seed, another sample
    fresh = LLM(llama_path, seed=5, max_num_batched_tokens=7)  # other engine, other chunking
    assert token_ids(fresh.generate(prompt, seeded, use_tqdm=False)) == alone
    assert_no_kv_leak(llm)


def test_stop_strings_cut_text_exactly(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = llm.generate("A small model", greedy, use_tqdm=False)[0].outputs[0]
    assert full.text == llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = full.text.index(stop)
    for include in (False, True):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=40,
            ignore_eos=True,
            stop=["never appears zz", stop],
            include_stop_str_in_output=include,
        )
        completion = llm.generate("A small model", params, use_tqdm=False)[0].outputs[0]
        assert completion.text == full.text[: cut + (len(stop) if include else 0)]
        assert completion.finish_reason == "stop" and completion.stop_reason == stop
        assert completion.token_ids == full.token_ids[: len(completion.token_ids)]
    assert_no_kv_leak(llm)


def test_n_completions_share_prompt_blocks(llm):
    kv = llm.engine_core.scheduler.kv_cache_manager
    kv.reset_prefix_cache()
    kv.make_prefix_cache_stats()
    prompt = {"prompt_token_ids": list(range(3, 43))}  # 40 tokens: 10 full blocks of 4
    params = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    # Children 1..3 hit the prompt blocks child 0 filled (all but the last block).
    assert kv.make_prefix_cache_stats().hits == 3 * 36
    assert_no_kv_leak(llm)


def test_length_limits(llm):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    completion = llm.generate("Count", params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == 30 and completion.finish_reason == "length"
    eos = llm.tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, stop_token_ids=[])
    completion = llm.generate("Count", params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == 10 and eos not in completion.token_ids
    assert_no_kv_leak(llm)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "Hi, who are you?"}]
    (output,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    expected = llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert output.prompt == expected
    assert output.prompt_token_ids == llm.tokenizer(expected, add_special_tokens=False).input_ids
    two = llm.chat([messages, messages], SamplingParams(temperature=0.0, max_tokens=5))
    assert two[0].outputs[0].token_ids == two[1].outputs[0].token_ids == output.outputs[0].token_ids
    assert_no_kv_leak(llm)


def test_bad_input_raises_and_engine_keeps_serving(llm):
    ok = SamplingParams(temperature=0.0, max_tokens=3)
    too_long = {"prompt_token_ids": [1] * llm.config.model.max_model_len}
    with pytest.raises(ValueError, match="maximum length"):
        llm.generate(["fine", too_long], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary|\\[0, "):
        llm.generate({"prompt_token_ids": [10**9]}, ok, use_tqdm=False)
    with pytest.raises(ValueError, match="text-only"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": [object()]}}, ok)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert_no_kv_leak(llm)
    assert len(llm.generate("still serving", ok, use_tqdm=False)[0].outputs[0].token_ids) > 0


def test_first_prompt_is_added_before_the_window_is_submitted(llm, monkeypatch):
    """The engine starts on the first ready prompt: ``generate`` adds it right after its own
    submission, not after the other prompts of the submit window; order is kept."""
    events = []
    submit, add = llm._submit, llm._add_request

    def logged_submit(prompt):
        events.append("submit")
        return submit(prompt)

    def logged_add(prompt, params, added):
        events.append("add")
        return add(prompt, params, added)

    monkeypatch.setattr(llm, "_submit", logged_submit)
    monkeypatch.setattr(llm, "_add_request", logged_add)
    prompts = [f"prompt number {i}" for i in range(6)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert events[:2] == ["submit", "add"] and events.count("add") == 6
    assert [o.prompt for o in outputs] == prompts
    assert_no_kv_leak(llm)
