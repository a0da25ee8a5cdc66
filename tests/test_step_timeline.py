"""The step timeline summary (``benchmarks/step_timeline.py``) on a hand-made two-run file."""

from __future__ import annotations

import json

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
