"""Keep the engine core's loop thread on the fast vCPUs of its machine.

At batch 256 a decode step's Python (schedule, inputs, update: a few us per request) takes
about as long as the GPU's step, so the loop thread's CPU speed sets the decode pace. On the
cloud GPU machines measured (H200 VMs of 16 vCPUs, BENCHMARKS.md, nineteenth session) one
VM's vCPUs ran the engine's own Python at speeds up to 1.66x apart
(``benchmarks/host_overhead.py`` under ``taskset``: 2.02-2.47 ms per step on five vCPUs,
2.97-3.35 on four); the guest sees 16 cores of one thread each, so the cause lies below it.
Workload 1's batches whose engine loop ran its decode steps at the slow pace reached 56-63% of
the roofline, those at the fast pace 64-65% (which vCPU each ran on was not recorded then).

So at start-up a CUDA engine core (the only engine process on its host) times a short
pure-Python workload on each vCPU its loop thread may use (``vcpu_timings``) and restricts that
thread to those within ``TOLERANCE`` of the fastest (``fast_vcpus``). On a machine whose vCPUs
are alike, that is all of them: nothing changes. Only the calling thread is restricted (Linux
affinity is per thread), and threads it starts later inherit the set; the engine core's input
and output threads, started earlier, keep theirs. ``MM_SERVE_ENGINE_CPUS`` overrides, for any
engine core: ``auto``, ``all`` (no restriction) or vCPU numbers such as ``0,2-5``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time

logger = logging.getLogger(__name__)

TOLERANCE = 0.25  # a vCPU at most 25% slower than the fastest is kept
SAMPLES = 7  # timed runs of the workload per vCPU; their median counts


def _workload(iterations: int = 12000) -> int:
    """Dict, list and integer work, like the scheduler's per-request bookkeeping."""
    counts: dict[int, int] = {}
    seen: list[int] = []
    for i in range(iterations):
        key = i & 255
        counts[key] = counts.get(key, 0) + i
        seen.append(key)
    return len(seen) + len(counts)


def vcpu_timings(vcpus: set[int]) -> dict[int, float]:
    """Median seconds of ``_workload`` on each vCPU, the calling thread moved to each in turn.

    Leaves the thread's affinity as it found it. Raises ``OSError`` where the platform refuses
    a vCPU (not in the thread's allowed set)."""
    allowed = os.sched_getaffinity(0)
    timings = {}
    try:
        for vcpu in sorted(vcpus):
            os.sched_setaffinity(0, {vcpu})
            _workload()  # the first run after the move warms the caches
            samples = []
            for _ in range(SAMPLES):
                start = time.perf_counter()
                _workload()
                samples.append(time.perf_counter() - start)
            timings[vcpu] = statistics.median(samples)
    finally:
        os.sched_setaffinity(0, allowed)
    return timings


def fast_vcpus(timings: dict[int, float], tolerance: float = TOLERANCE) -> set[int]:
    """The vCPUs whose time is within ``tolerance`` (a fraction) of the fastest."""
    best = min(timings.values())
    return {vcpu for vcpu, seconds in timings.items() if seconds <= best * (1 + tolerance)}


def parse_vcpus(text: str) -> set[int]:
    """``"0,2-5"`` -> ``{0, 2, 3, 4, 5}``. Raises ``ValueError`` on anything else."""
    vcpus: set[int] = set()
    try:
        for part in text.split(","):
            low, dash, high = part.strip().partition("-")
            vcpus.update(range(int(low), int(high if dash else low) + 1))
    except ValueError:
        vcpus = set()
    if not vcpus:
        raise ValueError(
            f"MM_SERVE_ENGINE_CPUS={text!r}: expected 'auto', 'all' or vCPUs such as '0,2-5'."
        )
    return vcpus


def pin_loop_thread(auto: bool = True) -> set[int] | None:
    """Restrict the calling thread to ``MM_SERVE_ENGINE_CPUS``'s vCPUs, else (``auto`` or unset,
    when ``auto``) to the fast ones; returns the set, or None where nothing was restricted
    (``all``, unset without ``auto``, one vCPU, no affinity support).

    Raises ``ValueError`` for a malformed ``MM_SERVE_ENGINE_CPUS`` or one naming vCPUs the
    process may not use."""
    setting = os.environ.get("MM_SERVE_ENGINE_CPUS", "auto" if auto else "all").strip()
    if setting == "all" or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    if setting != "auto":
        chosen = parse_vcpus(setting)
        if not chosen <= allowed:
            raise ValueError(
                f"MM_SERVE_ENGINE_CPUS={setting!r}: vCPUs {sorted(chosen - allowed)} are not "
                f"among this process's {sorted(allowed)}."
            )
    elif len(allowed) < 2:
        return None
    else:
        start = time.perf_counter()
        timings = vcpu_timings(allowed)
        chosen = fast_vcpus(timings)
        logger.info(
            "The engine loop's vCPUs: %d of %d within %.0f%% of the fastest (timed in %.0f ms; "
            "us per run: %s)",
            len(chosen),
            len(allowed),
            TOLERANCE * 100,
            (time.perf_counter() - start) * 1e3,
            ", ".join(f"{vcpu}: {seconds * 1e6:.0f}" for vcpu, seconds in timings.items()),
        )
    os.sched_setaffinity(0, chosen)
    return chosen
