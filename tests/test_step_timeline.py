"""The step timeline summary (``benchmarks/step_timeline.py``) on a hand-made two-run file;
the recorder's phase wrappers and its vCPU reading."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from mm_serve.benchmarks.step_timeline import load_runs, step_class, summarise


def _step(t0, launch_ms, host_ms, device_ms, gap_ms, tokens, reqs, images):
    return {
        "t0": t0,
        "launched": t0 + launch_ms / 1e3,
        "t1": t0 + host_ms / 1e3,
        "device_ms": device_ms,
        "gap_ms": gap_ms,
        "num_tokens": tokens,
        "num_reqs": reqs,
        "num_decode": reqs if tokens == reqs else 0,
        "num_images": images,
        "num_waiting": 0,
    }


def test_summary_splits_runs_and_classes(tmp_path):
    first = [_step(0.0, 1, 2, 1.5, 0.0, 4, 4, 0)]
    second = [
        _step(10.0, 100, 101, 120, 0.0, 8192, 30, 26),
        _step(10.101, 3, 5, 4, 2.5, 300, 3, 0),
        _step(10.106, 4, 6, 5, 1.0, 64, 64, 0),
        _step(10.112, 5, 7, 6, 0.5, 64, 64, 0),
    ]
    second[0].update(host_allocs=2, host_alloc_us=3100)  # counters: only where they moved
    second[0].update(schedule_ms=2.0, images_ms=30.0, inputs_ms=5.0, forward_ms=60.0)
    for step, ms, vcpu in zip(second[2:], (0.5, 0.7), (3, 5), strict=True):  # decode: no images
        step.update(schedule_ms=ms, inputs_ms=0.2, forward_ms=0.1, sample_ms=0.3, vcpu=vcpu)
    path = tmp_path / "tl.jsonl"
    lines = [*first, {"end_of_run": True}, *second, {"end_of_run": True}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    runs = load_runs(str(path))
    assert [len(run) for run in runs] == [1, 4]
    assert [step_class(r) for r in runs[1]] == ["encode", "prefill", "decode", "decode"]
    summary = summarise(runs[1])
    assert summary["wall_ms"] == pytest.approx(119.0)
    assert summary["device_ms_sum"] == pytest.approx(135.0)
    assert summary["gap_ms_sum"] == pytest.approx(4.0)
    decode = summary["classes"]["decode"]
    assert decode["steps"] == 2
    assert decode["device_ms_median"] == pytest.approx(5.5)
    assert decode["launch_ms_median"] == pytest.approx(4.5)
    assert decode["gap_ms_sum"] == pytest.approx(1.5)
    encode = summary["classes"]["encode"]
    assert encode["images_sum"] == 26
    assert (encode["host_allocs_sum"], encode["host_alloc_us_sum"]) == (2, 3100)
    assert decode["host_allocs_sum"] == decode["alloc_retries_sum"] == 0
    assert encode["images_ms_median"] == 30.0 and encode["sample_ms_median"] == 0.0
    assert decode["vcpus"] == {3: 1, 5: 1} and encode["vcpus"] == {}
    assert decode["schedule_ms_median"] == pytest.approx(0.6)
    assert decode["images_ms_median"] == 0.0 and decode["sample_ms_median"] == 0.3


class _Model:
    def __init__(self):
        self.tower_runner = lambda images: [len(images)]

    def embed_images(self, images):
        time.sleep(0.002)
        return self.tower_runner(images)

    def compute_logits(self, hidden):
        return hidden


class _Runner:
    def __init__(self):
        self.model = _Model()
        self.sampler = lambda logits: logits

    def execute_model(self, scheduler_output, *args):
        self.model.embed_images([1, 2])
        self.model.embed_images([3])
        return self.sample_tokens(self._forward(self._prepare_inputs(scheduler_output)))

    def launch_forward(self, scheduler_output):
        raise AssertionError("not called here")

    def _prepare_inputs(self, scheduler_output):
        return scheduler_output

    def _forward(self, inputs):
        time.sleep(0.005)
        return inputs

    def sample_tokens(self, hidden):
        return self._launch_output(self.sampler(self.model.compute_logits(hidden)))

    def _launch_output(self, tokens):
        return tokens


class _EngineCore:
    def __init__(self):
        self.model_runner = _Runner()

    def step(self):
        return self.model_runner.execute_model("out")


def test_timeline_times_the_runner_phases_into_the_current_step(tmp_path):
    """The phase wrappers (``PHASES``) add each call's host ms to the step being recorded, and
    pass calls outside a step through untimed."""
    from mm_serve.engine.step_timeline import PHASES, StepTimeline

    core = _EngineCore()
    timeline = StepTimeline(core, str(tmp_path / "tl.jsonl"))
    assert core.model_runner._prepare_inputs("x") == "x"  # no step: nothing recorded
    timeline.records.append({"t0": 0.0})
    assert timeline._execute("out") == "out"  # the runner's own execute_model, phases wrapped
    assert core.model_runner.model.embed_images([1]) == [1]
    record = timeline.records[-1]
    assert set(record) == {"t0", *(f"{phase}_ms" for phase in PHASES)}
    assert record["images_ms"] >= 3 * 2.0  # three calls in the step, summed
    assert record["forward_ms"] >= 5.0


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/stat"), reason="Linux /proc only")
def test_current_vcpu_is_the_one_the_thread_runs_on():
    """Each step records its loop thread's vCPU: a thread pinned to each vCPU reads that one."""
    from mm_serve.engine.step_timeline import current_vcpu

    seen = {}

    def run(vcpu):
        os.sched_setaffinity(0, {vcpu})
        seen[vcpu] = current_vcpu()

    for vcpu in sorted(os.sched_getaffinity(0)):
        thread = threading.Thread(target=run, args=(vcpu,))
        thread.start()
        thread.join()
    assert seen == {vcpu: vcpu for vcpu in seen}
