"""Summarise a step timeline (``engine/step_timeline.py``): where the device waited on the host.

    MM_SERVE_STEP_TIMELINE=tl.jsonl mm-serve bench throughput ...
    python -m mm_serve.benchmarks.step_timeline tl.jsonl

For the last recorded run (or ``--run N``), per class of step (encode: images go through the
tower; prefill: prompt tokens, no images; decode: one token per request): the step count, the
host's time per step (schedule to launched, and the whole ``step()``), the device span of
``execute_model`` and the device's idle gap before the step's kernels started. Device spans
include the bubbles inside a step where the host launched slower than the device ran. Each
class also sums its steps' counters (the caching allocators' new blocks and retries, the
engine thread's CPU time and page faults, garbage collections) and gives the median host ms of
each phase of a step: the schedule, the image encoder's launch (its tower replays within it),
the inputs, the forward pass, the sampling (its logits, sampler and copy to the host within it),
recorded when the runner is in the engine core's process. ``--steps`` prints each step, naming
after its phase times the phase calls that returned to an idle device (``<phase>_ms_drained``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict

from mm_serve.engine.step_timeline import PHASES

# Per step (``engine.step_timeline.step_counters``): the caching allocators' new blocks and
# retries, the engine thread's CPU time and page faults, garbage collections.
COUNTERS = (
    "host_allocs", "host_alloc_us", "device_allocs", "alloc_retries", "cpu_us", "page_faults",
    "gc_runs",
)  # fmt: skip


# Per step, with the runner in the engine core's process: host ms of the schedule and of the
# runner's phases (``engine.step_timeline.PHASES``).
PHASE_KEYS = ("schedule_ms", *(f"{phase}_ms" for phase in PHASES))


def load_runs(path: str) -> list[list[dict]]:
    runs, current = [], []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("end_of_run"):
                runs.append(current)
                current = []
            else:
                current.append(record)
    return runs


def step_class(record: dict) -> str:
    if record.get("num_images"):
        return "encode"
    if record.get("num_tokens", 0) > record.get("num_reqs", 0):
        return "prefill"
    return "decode" if record.get("num_tokens") else "empty"


def summarise(run: list[dict]) -> dict:
    """Totals (ms) of one run and per class: count, median host/launch/device ms, gap sum."""
    timed = [r for r in run if "device_ms" in r]
    wall_ms = (run[-1]["t1"] - run[0]["t0"]) * 1e3
    classes: dict[str, list[dict]] = defaultdict(list)
    for record in timed:
        classes[step_class(record)].append(record)
    per_class = {}
    for name, records in classes.items():
        per_class[name] = {
            "steps": len(records),
            "host_ms_median": statistics.median((r["t1"] - r["t0"]) * 1e3 for r in records),
            "launch_ms_median": statistics.median((r["launched"] - r["t0"]) * 1e3 for r in records),
            "device_ms_median": statistics.median(r["device_ms"] for r in records),
            "device_ms_sum": sum(r["device_ms"] for r in records),
            "gap_ms_sum": sum(r.get("gap_ms", 0.0) for r in records),
            "tokens_median": statistics.median(r["num_tokens"] for r in records),
            "reqs_median": statistics.median(r["num_reqs"] for r in records),
            "images_sum": sum(r["num_images"] for r in records),
            "vcpus": dict(Counter(r["vcpu"] for r in records if r.get("vcpu") is not None)),
            **{f"{k}_sum": sum(r.get(k, 0) for r in records) for k in COUNTERS},
            **{
                f"{k}_median": statistics.median(r.get(k, 0.0) for r in records) for k in PHASE_KEYS
            },
        }
    return {
        "wall_ms": wall_ms,
        "steps": len(run),
        "device_ms_sum": sum(r["device_ms"] for r in timed),
        "gap_ms_sum": sum(r.get("gap_ms", 0.0) for r in timed),
        "classes": per_class,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--run", type=int, default=-1, help="Which run (default: the last).")
    parser.add_argument("--steps", action="store_true", help="Also print every step.")
    args = parser.parse_args()
    run = load_runs(args.path)[args.run]
    summary = summarise(run)
    print(
        f"wall {summary['wall_ms']:.0f} ms, {summary['steps']} steps, device busy "
        f"{summary['device_ms_sum']:.0f} ms, idle gaps {summary['gap_ms_sum']:.0f} ms"
    )
    header = (
        "class steps tokens reqs images host_ms launch_ms device_ms device_sum gap_sum "
        + " ".join(COUNTERS)
    )
    print(header)
    for name, c in sorted(summary["classes"].items()):
        print(
            f"{name} {c['steps']} {c['tokens_median']:.0f} {c['reqs_median']:.0f} "
            f"{c['images_sum']} {c['host_ms_median']:.2f} {c['launch_ms_median']:.2f} "
            f"{c['device_ms_median']:.2f} {c['device_ms_sum']:.0f} {c['gap_ms_sum']:.0f} "
            + " ".join(f"{c[k + '_sum']:.0f}" for k in COUNTERS)
        )
    if any(k in r for r in run for k in PHASE_KEYS):
        print("class " + " ".join(PHASE_KEYS) + " (medians)")
        for name, c in sorted(summary["classes"].items()):
            print(f"{name} " + " ".join(f"{c[k + '_median']:.2f}" for k in PHASE_KEYS))
    for name, c in sorted(summary["classes"].items()):
        if c["vcpus"]:
            print(f"{name} steps per vCPU of the loop thread: {c['vcpus']}")
    if args.steps:
        t0 = run[0]["t0"]
        for r in run:
            print(
                f"{(r['t0'] - t0) * 1e3:8.1f} {step_class(r):8s} tok={r.get('num_tokens')} "
                f"reqs={r.get('num_reqs')} img={r.get('num_images')} wait={r['num_waiting']} "
                f"host={(r['t1'] - r['t0']) * 1e3:.2f} dev={r.get('device_ms', 0):.2f} "
                f"gap={r.get('gap_ms', 0):.2f} "
                + " ".join(f"{k}={r[k]:.0f}" for k in COUNTERS if k in r)
                + "".join(f" {k}={r[k]:.2f}" for k in PHASE_KEYS if k in r)
                + "".join(f" {k}" for k in PHASE_KEYS if r.get(f"{k}_drained"))
            )


if __name__ == "__main__":
    main()
