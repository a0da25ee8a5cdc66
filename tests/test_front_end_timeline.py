"""The front end's timeline (``benchmarks/front_end_timeline.py``): recorded around a real
``bench throughput`` process on the CPU, and summarised beside a hand-made step timeline."""

from __future__ import annotations

import json
import subprocess
import sys

from mm_serve.benchmarks.front_end_timeline import summarise

MODULE = [sys.executable, "-m", "mm_serve.benchmarks.front_end_timeline"]


def test_record_around_bench_throughput(tmp_path) -> None:
    """Each generate call (the warm-up, then the timed one) is one line: every request added
    once, inside the call, and every output token taken by some ``step()``."""
    path = tmp_path / "fe.jsonl"
    bench = ["bench", "throughput", "--num-prompts", "5", "--input-len", "8", "--output-len", "4"]
    bench += ["--image-size", "56", "56", "--model-arch", "tiny-qwen2-vl", "--device", "cpu"]
    bench += ["--max-model-len", "512", "--no-hf"]
    proc = subprocess.run(
        [*MODULE, "--record", str(path), *bench], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    timed = calls[-1]
    assert len(timed["adds"]) == 5
    assert timed["start"] <= timed["adds"][0] <= timed["adds"][-1] <= timed["end"]
    assert sum(outputs for _, _, outputs, _ in timed["steps"]) == 5 * 4  # one token each
    assert all(start <= end and seconds >= 0 for start, end, _, seconds in timed["steps"])


def test_summary_against_the_engine_steps(tmp_path) -> None:
    call = {
        "start": 100.0,
        "end": 101.6,
        "adds": [100.006, 100.5],
        "steps": [
            [100.0, 100.01, 0, 0.0],
            [100.01, 100.02, 256, 0.001],
            [100.02, 101.5, 2308, 0.03],
        ],
    }
    steps = [{"t0": 100.008}, {"t1": 101.59}]
    line = summarise(call, steps, 3)
    assert line.startswith("generate  1600.0 ms | 2 requests added 6.0-500.0 ms")
    assert "engine steps 8.0-1590.0 ms (return 10.0 ms after; step timeline run 3)" in line
    assert line.endswith("outputs: at most 2308 per step(), 31 ms to process")
    assert "engine steps" not in summarise(call, None)

    tl, fe = tmp_path / "tl.jsonl", tmp_path / "fe.jsonl"
    run = [{"t0": 100.008, "t1": 100.01}, {"t0": 101.5, "t1": 101.59}]
    tl.write_text("".join(json.dumps(r) + "\n" for r in run) + '{"end_of_run": true}\n')
    fe.write_text(json.dumps(call) + "\n")
    proc = subprocess.run(
        [*MODULE, "--summary", str(fe), str(tl)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "engine steps 8.0-1590.0 ms (return 10.0 ms after; step timeline run 0)" in proc.stdout
