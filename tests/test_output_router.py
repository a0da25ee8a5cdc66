"""``OutputRouter``: the engine core's split of a step's outputs among its clients (the
API-server processes of ``--api-server-count``), checked on hand-built outputs."""

from __future__ import annotations

import pytest

from mm_serve.engine.output_router import OutputRouter
from mm_serve.messages.outputs import EngineCoreOutput
from mm_serve.messages.wire import EngineCoreOutputs


def step(*request_ids: str, finished: tuple[str, ...] = ()) -> EngineCoreOutputs:
    outputs = [
        EngineCoreOutput(r, [7], finish_reason="stop" if r in finished else None)
        for r in request_ids
    ]
    return EngineCoreOutputs(outputs=outputs, timestamp=12.5)


def routed(parts: list[tuple[int, EngineCoreOutputs]]) -> dict[int, list[str]]:
    return {client: [o.request_id for o in message.outputs] for client, message in parts}


def test_one_client_gets_everything_untracked():
    router = OutputRouter(1)
    router.add("a", 0)
    message = step("a", "unknown")
    assert router.split(message) == [(0, message)]
    assert router.owners == {}


def test_outputs_go_to_their_owner_and_finished_ones_are_forgotten():
    router = OutputRouter(3)
    router.add("a", 0)
    router.add("b", 2)
    router.add("c", 2)
    parts = router.split(step("a", "b", "c", finished=("b",)))
    assert routed(parts) == {0: ["a"], 2: ["b", "c"]}
    assert all(message.timestamp == 12.5 for _, message in parts)
    assert router.owners == {"a": 0, "c": 2}


def test_aborted_and_unknown_requests_are_dropped():
    router = OutputRouter(2)
    router.add("a", 1)
    router.add("b", 0)
    router.remove(["a", "never-added"])
    assert routed(router.split(step("a", "b", "x"))) == {0: ["b"]}


def test_needs_a_client():
    with pytest.raises(ValueError, match="at least one client"):
        OutputRouter(0)
