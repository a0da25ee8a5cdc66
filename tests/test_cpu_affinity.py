"""The engine loop thread's vCPUs (``engine/cpu_affinity.py``): the fast-vCPU choice, the
``MM_SERVE_ENGINE_CPUS`` override, per-thread affinity, and a real engine core process whose
loop thread alone is restricted. Linux only (thread affinity)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from mm_serve.config import EngineArgs
from mm_serve.engine import cpu_affinity
from mm_serve.frontend.core_client import EngineCoreClient, EngineStartupError
from mm_serve.testing.vlm_checkpoints import build_tiny_vlm_checkpoint

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="needs Linux thread affinity"
)
ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def in_thread(fn):
    """``fn()``'s result and the thread's vCPUs after it, run in a fresh thread."""
    result = {}

    def run():
        result["value"] = fn()
        result["vcpus"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result["value"], result["vcpus"]


def test_fast_vcpus_keeps_those_within_the_tolerance() -> None:
    timings = {0: 2.02, 1: 3.18, 2: 3.20, 4: 2.12, 6: 3.35, 10: 2.47}  # ms, as measured
    assert cpu_affinity.fast_vcpus(timings) == {0, 4, 10}
    assert cpu_affinity.fast_vcpus(timings, tolerance=0.0) == {0}
    assert cpu_affinity.fast_vcpus({3: 1.0, 5: 1.1}) == {3, 5}


def test_parse_vcpus() -> None:
    assert cpu_affinity.parse_vcpus("0,2-5") == {0, 2, 3, 4, 5}
    assert cpu_affinity.parse_vcpus(" 7 ") == {7}
    for bad in ["", "x", "1,,2", "3-1", "0-"]:
        with pytest.raises(ValueError, match="MM_SERVE_ENGINE_CPUS"):
            cpu_affinity.parse_vcpus(bad)


def test_vcpu_timings_time_each_vcpu_and_restore_the_affinity() -> None:
    timings, after = in_thread(lambda: cpu_affinity.vcpu_timings(set(ALLOWED)))
    assert sorted(timings) == ALLOWED
    assert all(0 < seconds < 1 for seconds in timings.values())
    assert after == set(ALLOWED)


def test_pin_restricts_the_calling_thread_only(monkeypatch) -> None:
    vcpu = ALLOWED[-1]
    monkeypatch.setenv("MM_SERVE_ENGINE_CPUS", str(vcpu))
    assert in_thread(cpu_affinity.pin_loop_thread) == ({vcpu}, {vcpu})
    assert os.sched_getaffinity(0) == set(ALLOWED)
    monkeypatch.setenv("MM_SERVE_ENGINE_CPUS", str(max(ALLOWED) + 1))
    with pytest.raises(ValueError, match="not among this process's"):
        cpu_affinity.pin_loop_thread()
    monkeypatch.setenv("MM_SERVE_ENGINE_CPUS", "all")
    assert in_thread(cpu_affinity.pin_loop_thread) == (None, set(ALLOWED))
    monkeypatch.delenv("MM_SERVE_ENGINE_CPUS")
    assert in_thread(lambda: cpu_affinity.pin_loop_thread(auto=False)) == (None, set(ALLOWED))


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two vCPUs")
def test_auto_keeps_the_fast_vcpus(monkeypatch) -> None:
    """Unset or ``auto``: a slow vCPU is left out; with this machine's real timings, the
    thread runs on the vCPUs within the tolerance of the fastest."""
    slow, fast = ALLOWED[0], set(ALLOWED[1:])
    fake = {vcpu: 2.0 if vcpu == slow else 1.0 for vcpu in ALLOWED}
    monkeypatch.setattr(cpu_affinity, "vcpu_timings", lambda vcpus: fake)
    assert in_thread(cpu_affinity.pin_loop_thread) == (fast, fast)
    monkeypatch.undo()
    measured, real = {}, cpu_affinity.vcpu_timings
    monkeypatch.setattr(
        cpu_affinity, "vcpu_timings", lambda vcpus: measured.update(real(vcpus)) or measured
    )
    monkeypatch.setenv("MM_SERVE_ENGINE_CPUS", "auto")
    chosen, vcpus = in_thread(cpu_affinity.pin_loop_thread)
    assert chosen == vcpus == cpu_affinity.fast_vcpus(measured)
    assert sorted(measured) == ALLOWED and min(measured, key=measured.get) in chosen


def thread_vcpus(pid: int) -> dict[int, set[int]]:
    """Each thread of ``pid``: its vCPUs (``Cpus_allowed_list`` in /proc)."""
    lists = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists[int(task.name)] = cpu_affinity.parse_vcpus(line.split(":", 1)[1])
    return lists


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=3)


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two vCPUs")
def test_engine_core_restricts_its_loop_thread_only(vlm_path, monkeypatch) -> None:
    """A real engine core process: its main thread (the loop) on the vCPU asked for, its
    input and output threads still on every vCPU; a malformed setting fails the start."""
    vcpu = ALLOWED[-1]
    monkeypatch.setenv("MM_SERVE_ENGINE_CPUS", str(vcpu))
    client = EngineCoreClient(EngineArgs(model=vlm_path, max_model_len=512).create_engine_config())
    try:
        pid = client.engine_info.pid
        lists = thread_vcpus(pid)
        assert lists.pop(pid) == {vcpu}
        assert sum(1 for vcpus in lists.values() if vcpus == set(ALLOWED)) >= 2  # input, output
    finally:
        client.shutdown()
    monkeypatch.setenv("MM_SERVE_ENGINE_CPUS", "0-")
    config = EngineArgs(model=vlm_path, max_model_len=512).create_engine_config()
    with pytest.raises(EngineStartupError, match="MM_SERVE_ENGINE_CPUS='0-'"):
        EngineCoreClient(config)
