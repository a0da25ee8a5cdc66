"""``--scheduling-policy priority`` (vLLM's): waiting requests by ``(priority, arrival)``,
lower first; the lowest priority's newest running request preempted first; a priority without
the policy refused, by the engine and as a 400 naming ``priority``."""

from __future__ import annotations

import httpx
import pytest

from mm_serve.config import CacheConfig, SchedulerConfig
from mm_serve.messages.request import Request
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.sched.output import ModelRunnerOutput
from mm_serve.sched.scheduler import Scheduler
from tests.fixtures.server import RemoteServer, assert_group_gone


def make_scheduler(policy: str, num_blocks: int = 64, max_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=max_seqs, max_model_len=128,
        scheduling_policy=policy,
    )  # fmt: skip
    return Scheduler(config, CacheConfig(block_size=4), num_blocks)


def request(req_id: str, priority: int, arrival: float, num_prompt: int = 6) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tokens = list(range(int(100 * arrival), int(100 * arrival) + num_prompt))
    return Request(req_id, tokens, params, arrival_time=arrival, priority=priority)


def step(scheduler: Scheduler) -> dict[str, int]:
    """Schedule one step and sample a token for every request that finished its prompt."""
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [
        [7] if scheduler.requests[i].num_computed_tokens >= scheduler.requests[i].num_tokens else []
        for i in ids
    ]
    scheduler.update_from_output(out, ModelRunnerOutput(ids, sampled, [None] * len(ids), {}))
    return out.num_scheduled_tokens


def test_waiting_requests_run_by_priority_then_arrival():
    scheduler = make_scheduler("priority", max_seqs=2)
    for req_id, priority, arrival in [("late-low", 5, 1.0), ("early-mid", 1, 2.0),
                                      ("urgent", -3, 3.0), ("mid", 1, 4.0)]:  # fmt: skip
        scheduler.add_request(request(req_id, priority, arrival))
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "early-mid", "mid", "late-low"]
    assert set(step(scheduler)) == {"urgent", "early-mid"}  # two sequences at most


def test_the_lowest_priority_is_preempted_first():
    """A pool too small for three growing requests: the one of priority 9 goes, not the
    newest (priority 0), as FCFS would choose."""
    scheduler = make_scheduler("priority", num_blocks=9)
    scheduler.add_request(request("low", 9, 1.0))
    scheduler.add_request(request("high", 0, 2.0))
    scheduler.add_request(request("newest", 0, 3.0))
    for _ in range(40):
        step(scheduler)
        if scheduler.num_preemptions:
            break
    assert scheduler.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["low"]
    fcfs = make_scheduler("fcfs", num_blocks=9)
    for req_id, arrival in [("low", 1.0), ("high", 2.0), ("newest", 3.0)]:
        fcfs.add_request(request(req_id, 0, arrival))
    while not fcfs.num_preemptions:
        step(fcfs)
    assert [r.request_id for r in fcfs.waiting] == ["newest"]


def test_a_priority_needs_the_policy():
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        make_scheduler("fcfs").add_request(request("r", 1, 1.0))
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        make_scheduler("lifo")


def test_served_priorities(vlm_path, vlm_server):
    body = {"model": vlm_path, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    served = vlm_server.url  # FCFS: a priority is a 400 naming it
    refused = httpx.post(f"{served}/v1/completions", json={**body, "model": None, "priority": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    server = RemoteServer(vlm_path, ["--max-model-len", "512", "--scheduling-policy", "priority"])
    try:
        answers = [
            httpx.post(f"{server.url}/v1/completions", json={**body, "priority": p}, timeout=60)
            for p in (-1, 0, 7)
        ]
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1  # same greedy text
    finally:
        assert server.stop() == 0
    assert_group_gone(server.proc.pid)
