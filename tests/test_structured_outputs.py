"""Structured outputs in the engine: the sampler's bitmask, and grammar requests through
chunked prefill, async scheduling, preemption and ``n > 1`` beside plain requests, whose tokens
the grammars must not change (a tiny random-weight Qwen2, float32, offline ``LLM``)."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
import torch
import xgrammar

from mm_serve import LLM, SamplingParams
from mm_serve.messages.structured_outputs import StructuredOutputsParams, json_schema_grammar
from mm_serve.sched.structured_output import StructuredOutputManager
from mm_serve.worker.sampler import apply_logit_bias, apply_token_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tags", "ok"],
    "additionalProperties": False,
}
JSON = StructuredOutputsParams(json=json.dumps(SCHEMA))
PROMPTS = ["The cat sat on the mat and then " * 4, "Hello", "Numbers: one two three"]


def test_token_bitmask_matches_xgrammar() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 3), dtype=torch.int32, generator=generator)
    rows = torch.tensor([4, 0, 2])  # xgrammar takes a bitmask row per logits row
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=rows.tolist())
    assert torch.equal(apply_token_bitmask(logits, rows, bitmask[rows], 70), expected)
    # A tokenizer of 50 tokens, the vocabulary padded to 70: whatever the bits past token 50
    # say, the tokens past it are never allowed.
    narrow = apply_token_bitmask(logits, rows, bitmask[rows, :2], 50)
    assert torch.equal(narrow[:, :50], expected[:, :50])
    assert (narrow[rows, 50:] == float("-inf")).all() and torch.equal(narrow[1], logits[1])


def test_length_bound_json_strings_take_no_control_character() -> None:
    """xgrammar lets a raw tab into a string with maxLength, which JSON forbids unescaped
    (``json.loads`` refuses it); ``json_schema_grammar`` takes control characters out."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}}
    grammar = json_schema_grammar(json.dumps(schema | {"required": ["name"]}))
    assert accepts(grammar, '{"name": "ab c"}')
    for text in ('{"name": "a\tb"}', '{"name": "a\x01"}', '{"name": "abcdef"}'):
        assert not accepts(grammar, text)


def test_logit_bias_adds_to_its_tokens() -> None:
    logits = torch.zeros(2, 10)
    biased = apply_logit_bias(logits, {1: {3: 5.0, 7: -2.5}})
    expected = torch.zeros(2, 10)
    expected[1, 3], expected[1, 7] = 5.0, -2.5
    assert torch.equal(biased, expected) and not logits.any()


PLAIN = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_texts(qwen2_path) -> list[list[str]]:
    """The default engine's texts for ``PROMPTS`` under ``PLAIN``, alone (one list each)."""
    reference = LLM(qwen2_path, dtype="float32")
    outputs = reference.generate(PROMPTS, PLAIN, use_tqdm=False)
    reference.shutdown()
    return [[o.outputs[0].text] for o in outputs]


def _generate(llm, grammar_params, plain_params):
    """Grammar and plain requests interleaved in one batch; returns (grammar, plain) texts."""
    prompts, params = [], []
    for prompt in PROMPTS:
        prompts += [prompt, prompt]
        params += [grammar_params, plain_params]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    texts = [[c.text for c in o.outputs] for o in outputs]
    return texts[0::2], texts[1::2]


@pytest.mark.parametrize(
    "engine_args",
    [
        {"async_scheduling": False},
        {"async_scheduling": True},
        {"async_scheduling": True, "max_num_batched_tokens": 8},  # chunked prefill
        {"async_scheduling": True, "block_size": 4, "num_kv_blocks": 24},  # preemption
        {"async_scheduling": True, "distributed_executor_backend": "mp"},  # a worker process
    ],
)
def test_grammar_requests_beside_plain_ones(qwen2_path, plain_texts, engine_args) -> None:
    grammar = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=60, structured_outputs=JSON)
    llm = LLM(qwen2_path, dtype="float32", multiprocess=False, **engine_args)
    constrained, unconstrained = _generate(llm, grammar, PLAIN)
    assert unconstrained == plain_texts
    for texts in constrained:
        assert len(texts) == 2
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMA)
    if "num_kv_blocks" in engine_args:
        assert llm.engine_core.scheduler.num_preemptions > 0
    kv = llm.engine_core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # nothing leaked


def test_compiling_does_not_hold_up_other_requests(qwen2_path, monkeypatch) -> None:
    """A grammar still compiling keeps its request waiting; the engine serves the rest."""
    release = threading.Event()
    compile_grammar = StructuredOutputManager._compile

    def slow_compile(self, key):
        assert release.wait(60)
        return compile_grammar(self, key)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    llm = LLM(qwen2_path, dtype="float32", multiprocess=False)
    core = llm.engine_core
    grammar = SamplingParams(temperature=0, max_tokens=100, structured_outputs=JSON)
    prompt = llm.input_processor.process(PROMPTS[1]).result()
    constrained = llm._add_request(prompt, (grammar, None), [])
    plain = llm._add_request(prompt, (SamplingParams(temperature=0, max_tokens=5), None), [])
    finished = set()
    for _ in range(20):
        finished |= {o.request_id for o in core.step() if o.finish_reason}
    assert finished == {plain}
    assert core.scheduler.requests[constrained].num_computed_tokens == 0
    release.set()
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    assert outputs[-1].finish_reason == "stop"
    tokens = [t for o in outputs for t in o.new_token_ids][:-1]  # the last: a stop token
    jsonschema.validate(json.loads(llm.input_processor.tokenizer.decode(tokens)), SCHEMA)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(regex="(a"), "Invalid regex"),
        (StructuredOutputsParams(json='{"type": 5}'), "Invalid json"),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_value_error(qwen2_path, params, message):
    llm = LLM(qwen2_path, dtype="float32", multiprocess=False)
    with pytest.raises(ValueError, match=message):
        llm.generate("Hi", SamplingParams(structured_outputs=params), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias token ids"):
        llm.generate("Hi", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text


def test_params_take_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    assert StructuredOutputsParams(choice=['say "hi"']).key == ("grammar", r'root ::= "say \"hi\""')


def test_a_grammar_that_fails_in_the_engine_ends_its_request(qwen2_path, monkeypatch) -> None:
    """Past the front end's check (another tokenizer's vocabulary could still fail): the
    request finishes as aborted, with an output, and holds nothing."""

    def failing_compile(self, key):
        raise RuntimeError("[04:35:06] /project/cpp/compiler.cc:7: no luck")

    monkeypatch.setattr(StructuredOutputManager, "_compile", failing_compile)
    llm = LLM(qwen2_path, dtype="float32", multiprocess=False)
    params = [SamplingParams(max_tokens=3, structured_outputs=JSON), SamplingParams(max_tokens=3)]
    failed, served = llm.generate(["Hi", "Hi"], params, use_tqdm=False)
    assert (failed.outputs[0].finish_reason, failed.outputs[0].token_ids) == ("abort", [])
    assert served.outputs[0].finish_reason == "length"
    scheduler = llm.engine_core.scheduler
    assert not scheduler.requests and not scheduler.has_unfinished_requests()
