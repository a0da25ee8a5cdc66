"""The front end's preprocessing rate (``benchmarks/preprocess_rate.py``): its window against a
recording stand-in, and the script itself in a real process on the CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

from mm_serve.benchmarks.preprocess_rate import ready_times


class RecordingProcessor:
    """``process`` returns a pending prompt at once and tracks how many are submitted and not
    yet taken (``result()``), and the order they were taken in."""

    def __init__(self) -> None:
        self.in_flight, self.most, self.order = 0, 0, []

    def process(self, prompt):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        return SimpleNamespace(result=lambda: self._take(prompt))

    def _take(self, prompt):
        self.in_flight -= 1
        self.order.append(prompt)
        return prompt


def test_ready_times_keeps_the_window_and_the_order() -> None:
    processor = RecordingProcessor()
    ready = ready_times(processor, list(range(10)), window=3)
    assert processor.order == list(range(10))
    assert processor.most == 3 and processor.in_flight == 0
    assert len(ready) == 10 and ready == sorted(ready) and ready[0] >= 0


def test_the_script_on_tiny_qwen2_vl() -> None:
    command = [sys.executable, "-m", "mm_serve.benchmarks.preprocess_rate", "--num-prompts", "30"]
    command += ["--model-arch", "tiny-qwen2-vl", "--image-size", "56", "56", "--device", "cpu"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = re.search(r"30 prompts, \d+ workers, window 32: 26th ready at ([\d.]+) ms, all at "
                     r"([\d.]+) ms \(([\d.]+) ms per prompt\)", proc.stdout)  # fmt: skip
    assert line is not None, proc.stdout
    twenty_sixth, last, per_prompt = map(float, line.groups())
    assert 0 < twenty_sixth <= last and abs(per_prompt - last / 30) < 0.01
