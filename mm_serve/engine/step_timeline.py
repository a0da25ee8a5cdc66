"""A timeline of the engine core's steps, for finding where the device waits on the host.

Set ``MM_SERVE_STEP_TIMELINE=<file>`` and the engine core (in whichever process it runs)
records, for every step, host times (schedule start, launch done, step done; with the runner
in the process, the host ms of the schedule and of the runner's phases, ``PHASES``), two CUDA
events around ``execute_model``, and counters of what the step's host time went to (the caching
allocators' new blocks, the thread's CPU time and page faults, garbage collections:
``step_counters``) and the vCPU the step ended on; nothing is synchronised during the run.
Each time the engine runs out of requests, it waits for the device once and appends one JSON
line per step to the file. ``benchmarks/step_timeline.py`` reads it: the gap between one
step's end event and the next one's start event is time the device sat idle because the host
had not launched it yet.
With the runner in a worker process (``distributed_executor_backend`` "mp" or "ray") the
events time nothing on this process's stream: only the host times hold.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import time
from typing import Any

import torch

ENV = "MM_SERVE_STEP_TIMELINE"


def install_from_env(engine_core: Any) -> None:
    """Wrap ``engine_core.step`` with a recorder when ``MM_SERVE_STEP_TIMELINE`` names a file
    and the engine runs on CUDA (CUDA events time the device)."""
    path = os.environ.get(ENV)
    if path and engine_core.config.device.type == "cuda":
        StepTimeline(engine_core, path)


def step_counters() -> dict[str, float]:
    """Running totals behind a step's host time: the CUDA caching allocators' (torch's
    ``host_memory_stats`` and ``memory_stats``) pinned host blocks created (``host_allocs``)
    and microseconds in those CUDA calls (``host_alloc_us``), device segments created
    (``device_allocs``) and allocations retried after freeing the cache (``alloc_retries``);
    this thread's CPU time (``cpu_us``, user and system) and minor page faults
    (``page_faults``); the garbage collector's runs (``gc_runs``, all generations)."""
    host = torch.cuda.host_memory_stats_as_nested_dict()
    device = torch.cuda.memory_stats_as_nested_dict()
    return {
        "host_allocs": host.get("num_host_alloc", 0),
        "host_alloc_us": host.get("host_alloc_time", {}).get("total", 0),
        "device_allocs": device.get("num_device_alloc", 0),
        "alloc_retries": device.get("num_alloc_retries", 0),
        "cpu_us": time.thread_time_ns() // 1000,
        "page_faults": resource.getrusage(resource.RUSAGE_THREAD).ru_minflt,
        "gc_runs": sum(generation["collections"] for generation in gc.get_stats()),
    }


def current_vcpu() -> int | None:
    """The vCPU this thread ran on last (Linux: field 39 of ``/proc/thread-self/stat``), or
    None where that file is missing (a step's host time can follow its vCPU's speed)."""
    try:
        with open("/proc/thread-self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[36])  # fields from the third on, after comm


# The phases of a step whose host ms each record holds (as ``<phase>_ms``) when the runner is
# in the engine core's process: the schedule (to ``execute_model``), then the runner's. The
# last four are parts of the one before them: the tower's graph replays (within "images"),
# and the logits, the sampler and the tokens' copy to the host (within "sample").
PHASES = {
    "images": ("model", "embed_images"),  # the vision encoder's launch and pixel staging
    "inputs": ("runner", "_prepare_inputs"),
    "forward": ("runner", "_forward"),
    "sample": ("runner", "sample_tokens"),
    "tower": ("model", "tower_runner"),
    "logits": ("model", "compute_logits"),
    "sampler": ("runner", "sampler"),
    "output": ("runner", "_launch_output"),
}


# A phase call longer than this records whether the device had run out of work when it
# returned (``<phase>_ms_drained``): a call that waited for the device to finish everything
# queued (a synchronisation) returns to an idle device; one throttled by a full launch queue
# returns to a busy one.
LONG_CALL_MS = 5.0


class StepTimeline:
    """Records ``engine_core``'s steps into ``path`` (JSON lines, appended)."""

    def __init__(self, engine_core: Any, path: str) -> None:
        self.engine_core = engine_core
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._step = engine_core.step
        self._execute = engine_core.model_runner.execute_model
        engine_core.step = self.step
        engine_core.model_runner.execute_model = self.execute_model
        runner = engine_core.model_runner
        if hasattr(runner, "launch_forward"):  # the runner in this process: time its phases
            for phase, (owner, name) in PHASES.items():
                target = runner.model if owner == "model" else runner
                if getattr(target, name, None) is not None:  # (no tower runner: eager)
                    setattr(target, name, self._timed(getattr(target, name), f"{phase}_ms"))

    def _timed(self, fn, key: str):
        """``fn``, adding its host ms to the current step's ``key`` (summed over calls)."""

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.records:
                    record = self.records[-1]
                    ms = (time.perf_counter() - start) * 1e3
                    record[key] = record.get(key, 0.0) + ms
                    if ms > LONG_CALL_MS and torch.cuda.is_initialized():  # device drained?
                        record[f"{key}_drained"] = torch.cuda.current_stream().query()

        return timed

    def execute_model(self, scheduler_output, *args):
        if not self.records:  # outside step() (the empty step of ``reset``): not recorded
            return self._execute(scheduler_output, *args)
        self.records[-1]["schedule_ms"] = (time.perf_counter() - self.records[-1]["t0"]) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        pending = self._execute(scheduler_output, *args)
        end.record()
        num_scheduled = scheduler_output.num_scheduled_tokens
        self.records[-1].update(
            launched=time.perf_counter(),
            events=(start, end),
            num_reqs=len(num_scheduled),
            num_tokens=scheduler_output.total_num_scheduled_tokens,
            num_decode=sum(1 for n in num_scheduled.values() if n == 1),
            num_images=sum(len(v) for v in scheduler_output.scheduled_encoder_inputs.values()),
        )
        return pending

    def step(self):
        waiting = len(self.engine_core.scheduler.waiting)
        before = step_counters()
        self.records.append({"t0": time.perf_counter(), "num_waiting": waiting})
        outputs = self._step()
        self.records[-1]["t1"] = time.perf_counter()
        self.records[-1]["vcpu"] = current_vcpu()
        after = step_counters()
        self.records[-1].update({k: after[k] - before[k] for k in after if after[k] != before[k]})
        if not self.engine_core.has_unfinished_requests():
            self.flush()
        return outputs

    def flush(self) -> None:
        """Wait for the device, then append the recorded steps to the file."""
        torch.cuda.synchronize()
        lines = []
        previous_end = None
        for record in self.records:
            events = record.pop("events", None)
            if events is not None:
                start, end = events
                record["device_ms"] = start.elapsed_time(end)
                if previous_end is not None:
                    record["gap_ms"] = previous_end.elapsed_time(start)
                previous_end = end
            lines.append(json.dumps(record))
        lines.append(json.dumps({"end_of_run": True}))
        self.records.clear()
        with open(self.path, "a") as f:
            f.write("".join(line + "\n" for line in lines))
