"""Async scheduling in the scheduler: step n + 1 is scheduled before step n's tokens are known.

Hand-made runner outputs, no model: ``launch`` schedules a step, ``finish`` later hands it the
sampled tokens, in the order the engine core does it (schedule n + 1, then update n).
"""

from __future__ import annotations

from test_scheduler import assert_all_blocks_free, make_request, make_scheduler

from mm_serve.messages.request import RequestStatus
from mm_serve.sched.output import ModelRunnerOutput


def launch(scheduler):
    """Schedule a step; remember which requests sample a token in it."""
    before = {r: req.num_output_placeholders for r, req in scheduler.requests.items()}
    out = scheduler.schedule()
    sampling = {
        r
        for r in out.num_scheduled_tokens
        if scheduler.requests[r].num_output_placeholders > before.get(r, 0)
    }
    return out, sampling


def finish(scheduler, launched, token=1000):
    out, sampling = launched
    req_ids = list(out.num_scheduled_tokens)
    sampled = [[token] if r in sampling else [] for r in req_ids]
    return scheduler.update_from_output(
        out, ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids), {})
    )


def test_decode_is_scheduled_before_the_last_token_is_known():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5))
    request = scheduler.requests["a"]
    step1 = launch(scheduler)
    assert request.num_output_placeholders == 1
    step2 = launch(scheduler)  # the token of step 1 is still unknown
    assert step2[0].num_scheduled_tokens == {"a": 1}
    assert (request.num_computed_tokens, request.num_output_placeholders) == (6, 2)
    outputs = finish(scheduler, step1, token=7)
    assert [o.new_token_ids for o in outputs] == [[7]]
    assert (request.num_tokens, request.num_output_placeholders) == (6, 1)
    finish(scheduler, step2, token=8)
    assert request.output_token_ids == [7, 8] and request.num_output_placeholders == 0


def test_no_work_past_max_tokens_while_the_last_token_is_in_flight():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5, max_tokens=2))
    step1, step2 = launch(scheduler), launch(scheduler)
    step3 = launch(scheduler)  # both tokens are in flight: nothing more to compute
    assert step3[0].num_scheduled_tokens == {}
    finish(scheduler, step1)
    outputs = finish(scheduler, step2)
    assert outputs[0].finish_reason == "length"
    assert outputs[0].new_token_ids == [1000]
    finish(scheduler, step3)
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_stop_token_found_late_discards_the_step_in_flight():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5, eos=99))
    step1, step2 = launch(scheduler), launch(scheduler)
    outputs = finish(scheduler, step1, token=99)  # EOS: step 2 computed one token too many
    assert outputs[0].finish_reason == "stop"
    assert_all_blocks_free(scheduler)
    assert finish(scheduler, step2, token=5) == []  # its output is dropped
    step3 = launch(scheduler)
    assert step3[0].finished_req_ids == {"a"}  # the runner drops the request


def test_request_preempted_with_a_token_in_flight_waits_for_it():
    scheduler = make_scheduler(num_blocks=3, caching=False)
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 4, first_token=50))
    step1 = launch(scheduler)  # both prefill, one block each; both sample
    launch(scheduler)  # "a" takes the last block; "b" is preempted, its token in flight
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # room for "b" again
    step3 = launch(scheduler)
    assert "b" not in step3[0].num_scheduled_tokens  # its token is still unknown
    finish(scheduler, step1, token=3)
    assert b.output_token_ids == [3] and b.num_output_placeholders == 0
    step4 = launch(scheduler)
    assert step4[0].num_scheduled_tokens == {"b": 5}  # prompt and output, recomputed
    assert b.num_output_placeholders == 1


def test_two_steps_in_flight_past_a_late_stop_token_are_discarded():
    """A worker process keeps two steps in flight: the stop token of step 1 is read after
    steps 2 and 3 are scheduled; both outputs are dropped and nothing leaks."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5, eos=99))
    step1, step2, step3 = launch(scheduler), launch(scheduler), launch(scheduler)
    request = scheduler.requests["a"]
    assert step3[0].num_scheduled_tokens == {"a": 1} and request.num_output_placeholders == 3
    outputs = finish(scheduler, step1, token=99)
    assert outputs[0].finish_reason == "stop" and outputs[0].new_token_ids == [99]
    assert_all_blocks_free(scheduler)
    assert finish(scheduler, step2, token=5) == [] and finish(scheduler, step3, token=6) == []
    assert launch(scheduler)[0].finished_req_ids == {"a"}
