"""Scheduler tests with hand-built requests and hand-made runner outputs (no model)."""

from __future__ import annotations

import pytest

from mm_serve.config import CacheConfig, SchedulerConfig
from mm_serve.messages.request import Request, RequestStatus
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.sched.output import ModelRunnerOutput, SchedulerOutput
from mm_serve.sched.scheduler import Scheduler

BLOCK = 4


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, max_len=128, caching=True):
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len
    )
    return Scheduler(
        config, CacheConfig(block_size=BLOCK, enable_prefix_caching=caching), num_blocks
    )


def make_request(req_id, num_prompt, first_token=0, eos=None, **params):
    tokens = list(range(first_token, first_token + num_prompt))
    params.setdefault("max_tokens", 8)
    return Request(req_id, tokens, SamplingParams(temperature=0.0, **params), eos_token_id=eos)


def run_step(scheduler: Scheduler, token=1000) -> tuple[SchedulerOutput, list]:
    """Schedule, then pretend the model sampled ``token`` for every request done with its prompt."""
    out = scheduler.schedule()
    req_ids, sampled = [], []
    for req_id in out.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        req_ids.append(req_id)
        sampled.append([token] if request.num_computed_tokens == request.num_tokens else [])
    runner_output = ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids), {})
    return out, scheduler.update_from_output(out, runner_output)


def assert_all_blocks_free(scheduler: Scheduler):
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_chunked_prefill_respects_token_budget():
    scheduler = make_scheduler(budget=10)
    scheduler.add_request(make_request("a", 25))
    scheduler.add_request(make_request("b", 3, first_token=100))
    out, outputs = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 10}
    assert outputs == []  # "a" is mid-prompt: nothing sampled
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 10}
    out, outputs = run_step(scheduler)
    # "a" finishes its prompt (5 tokens) and "b" fills the rest of the budget.
    assert out.num_scheduled_tokens == {"a": 5, "b": 3}
    assert [o.request_id for o in outputs] == ["a", "b"]
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # both decoding


def test_new_request_sent_whole_once_then_diffs():
    scheduler = make_scheduler(budget=100)
    scheduler.add_request(make_request("a", 9))
    out, _ = run_step(scheduler)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"]
    assert out.scheduled_new_reqs[0].block_ids == [0, 1, 2]
    out, _ = run_step(scheduler)
    assert out.scheduled_new_reqs == []
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [9]
    assert out.scheduled_cached_reqs.new_block_ids == [[]]  # token 10 still fits block 2


def test_max_num_seqs_limits_running():
    scheduler = make_scheduler(max_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 4, first_token=10 * i))
    out, _ = run_step(scheduler)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_preemption_takes_newest_and_recomputes():
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens take 2 blocks each and grow.
    scheduler = make_scheduler(num_blocks=6, caching=False, max_len=64)
    scheduler.add_request(make_request("old", 8, max_tokens=12))
    scheduler.add_request(make_request("new", 8, first_token=50, max_tokens=12))
    for _ in range(5):
        run_step(scheduler)  # prefill, then decode positions 8..11 into a third block each
    assert scheduler.num_preemptions == 0
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    new = scheduler.requests["new"]
    out, _ = run_step(scheduler)  # "old" needs a fourth block: the newest request goes
    assert scheduler.num_preemptions == 1
    assert list(out.num_scheduled_tokens) == ["old"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert list(scheduler.waiting) == [new]
    assert len(scheduler.kv_cache_manager.get_block_ids("old")) == 4
    while "new" not in out.num_scheduled_tokens:
        num_tokens = new.num_tokens
        out, _ = run_step(scheduler)
    cached = out.scheduled_cached_reqs
    i = cached.req_ids.index("new")
    # Resumed: a fresh block list, and the prompt plus the outputs so far recomputed.
    assert cached.resumed_from_preemption[i] and cached.num_computed_tokens[i] == 0
    assert out.num_scheduled_tokens["new"] == num_tokens
    assert len(cached.new_block_ids[i]) == -(-num_tokens // BLOCK)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert_all_blocks_free(scheduler)


def test_stop_conditions():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", 4, eos=7))
    scheduler.add_request(make_request("stop_id", 4, first_token=20, stop_token_ids=[7]))
    scheduler.add_request(
        make_request("ignore", 4, first_token=40, eos=7, ignore_eos=True, max_tokens=3)
    )
    scheduler.add_request(make_request("min", 4, first_token=60, eos=7, min_tokens=2))
    finished = {}
    for _ in range(5):
        _, outputs = run_step(scheduler, token=7)
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert finished["eos"].finish_reason == "stop" and finished["eos"].stop_reason is None
    assert finished["stop_id"].finish_reason == "stop" and finished["stop_id"].stop_reason == 7
    assert finished["ignore"].finish_reason == "length"
    assert finished["min"].finish_reason == "stop"
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_max_tokens_and_max_model_len():
    scheduler = make_scheduler(max_len=10)
    scheduler.add_request(make_request("len", 8, max_tokens=100))
    scheduler.add_request(make_request("max", 3, first_token=30, max_tokens=2))
    counts = {}
    while scheduler.has_unfinished_requests():
        _, outputs = run_step(scheduler)
        for o in outputs:
            counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
    assert counts == {"len": 2, "max": 2}
    assert_all_blocks_free(scheduler)


def test_abort_frees_blocks_and_tells_runner():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10, first_token=50))
    run_step(scheduler)
    scheduler.add_request(make_request("waiting", 5, first_token=90))
    scheduler.finish_requests(["a", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a", "waiting"}
    assert list(out.num_scheduled_tokens) == ["b"]
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert_all_blocks_free(scheduler)


def test_prefix_hit_skips_computed_tokens():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    run_step(scheduler)
    scheduler.add_request(make_request("b", 10))  # same tokens: 2 full blocks hit
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens["b"] == 2
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8


def test_prompt_too_long_rejected():
    scheduler = make_scheduler(num_blocks=4, max_len=100)
    with pytest.raises(ValueError, match="maximum length"):
        scheduler.add_request(make_request("long", 100))
    with pytest.raises(ValueError, match="KV blocks"):
        scheduler.add_request(make_request("big", 40))
    assert not scheduler.has_unfinished_requests()


class _NoSlotLimits(dict):
    """``KVCacheManager.slot_limits`` that never lets a request take the decode fast path."""

    def get(self, key, default=None):
        return 0


def decisions_and_outputs(fast_path: bool, in_flight: int) -> tuple[list, int, int]:
    """Run ten requests (chunked prompts, EOS, max_tokens, preemption in a small pool) with
    ``in_flight`` steps launched ahead of their update; returns every step's decisions and
    outputs, the number of ``allocate_slots`` calls and of preemptions."""
    scheduler = make_scheduler(num_blocks=13, budget=12, max_seqs=6)
    kv = scheduler.kv_cache_manager
    if not fast_path:
        kv.slot_limits = _NoSlotLimits()
    calls = []
    allocate = kv.allocate_slots
    kv.allocate_slots = lambda *args: calls.append(args[1]) or allocate(*args)
    for i in range(10):
        request = make_request(
            f"r{i}", 3 + 2 * i, first_token=10 * i, eos=1003, max_tokens=8 + 2 * i
        )
        scheduler.add_request(request)
    trace, launched = [], []
    for step in range(400):
        placeholders = {i: r.num_output_placeholders for i, r in scheduler.requests.items()}
        out = scheduler.schedule()
        cached = out.scheduled_cached_reqs
        trace.append(
            (
                dict(out.num_scheduled_tokens),
                [n.req_id for n in out.scheduled_new_reqs],
                list(zip(*vars(cached).values(), strict=True)),
                sorted(out.finished_req_ids),
            )
        )
        requests = [scheduler.requests[r] for r in out.num_scheduled_tokens]
        sampled = [  # a window that reaches the end samples: the scheduler adds a placeholder
            [1000 + (step + len(r.output_token_ids)) % 7]
            if r.num_output_placeholders > placeholders[r.request_id]
            else []
            for r in requests
        ]
        req_ids = list(out.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(req_ids, sampled, [None] * len(requests), {})
        launched.append((out, runner_output))
        while len(launched) > in_flight:
            outputs = scheduler.update_from_output(*launched.pop(0))
            trace.append([(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs])
        if not scheduler.has_unfinished_requests() and not launched:
            break
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)
    return trace, len(calls), scheduler.num_preemptions


@pytest.mark.parametrize("in_flight", [0, 1])
def test_decode_fast_path_decides_as_the_general_path(in_flight):
    fast, fast_calls, preemptions = decisions_and_outputs(True, in_flight)
    general, general_calls, _ = decisions_and_outputs(False, in_flight)
    assert fast == general and preemptions > 0
    # With 4-token blocks and prefix caching, half the decode steps allocate or register.
    assert fast_calls < 0.75 * general_calls
