"""The torch profiler over a span of the engine's work, as vLLM's ``start_profile`` /
``stop_profile``: set ``MM_SERVE_TORCH_PROFILER_DIR`` to a folder, call ``LLM.start_profile()``,
run requests, call ``LLM.stop_profile()``. The engine core process (where the model runs at one
rank by default) and each tensor-parallel worker process write one Chrome trace each
(``.pt.trace.json.gz``) into the folder; ``chrome://tracing`` or Perfetto opens it.

``MM_SERVE_TORCH_PROFILER_ACTIVITIES``: "cpu,cuda" (the default; CUDA only where the process
has a GPU) or "cuda" alone, which records the device's kernels and copies but no host
operators, and so adds almost no host time to the steps it profiles.
"""

from __future__ import annotations

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

DIR_ENV = "MM_SERVE_TORCH_PROFILER_DIR"
ACTIVITIES_ENV = "MM_SERVE_TORCH_PROFILER_ACTIVITIES"
_ACTIVITIES = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}


def profiler_dir() -> str:
    """The trace folder (``MM_SERVE_TORCH_PROFILER_DIR``). Raises RuntimeError when unset."""
    directory = os.environ.get(DIR_ENV, "")
    if not directory:
        raise RuntimeError(f"Profiling is off: set {DIR_ENV} to a folder for the traces.")
    return directory


def profiler_activities() -> list[ProfilerActivity]:
    """The activities of ``MM_SERVE_TORCH_PROFILER_ACTIVITIES`` that this process can record
    (CUDA only with a GPU). Raises ValueError on an unknown name."""
    names = [n.strip() for n in os.environ.get(ACTIVITIES_ENV, "cpu,cuda").split(",") if n.strip()]
    unknown = sorted(set(names) - set(_ACTIVITIES))
    if unknown:
        raise ValueError(f"{ACTIVITIES_ENV}: unknown activities {unknown}; use cpu and cuda.")
    return [
        _ACTIVITIES[name]
        for name in dict.fromkeys(names)
        if name != "cuda" or torch.cuda.is_available()
    ]


class TorchProfiler:
    """One process's profiler; ``name`` goes into its trace's file name (e.g. "rank0")."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.running = False
        self._profile: profile | None = None  # None while running: nothing to record here

    def start(self) -> None:
        """Start recording. Raises RuntimeError when profiling is off (``profiler_dir``) or
        already running; ValueError as ``profiler_activities``."""
        profiler_dir()
        if self.running:
            raise RuntimeError("The profiler is already running.")
        activities = profiler_activities()
        if activities:  # none: "cuda" alone in a process without a GPU
            self._profile = profile(activities=activities)
            self._profile.start()
        self.running = True

    def stop(self) -> str | None:
        """Stop recording and write the trace; returns its path (None: nothing recorded).
        Raises RuntimeError when profiling is off or not running."""
        directory = profiler_dir()
        if not self.running:
            raise RuntimeError("The profiler is not running: call start_profile() first.")
        recording, self._profile, self.running = self._profile, None, False
        if recording is None:
            return None
        recording.stop()
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(
            directory, f"mm_serve-{self.name}-{os.getpid()}-{time.time_ns()}.pt.trace.json.gz"
        )
        recording.export_chrome_trace(path)
        return path
