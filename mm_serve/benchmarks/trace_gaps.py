"""Where the device idled in a Chrome trace of the engine (``LLM.start_profile`` /
``stop_profile`` with ``MM_SERVE_TORCH_PROFILER_DIR``; ``mm_serve.profiler``).

    python -m mm_serve.benchmarks.trace_gaps <folder>/mm_serve-rank0-*.pt.trace.json.gz

Prints, for each trace, the union of the device's kernels, copies and memsets against their
span (busy and idle ms), the idle gaps by size, and the largest gaps with the activities on
either side. Record with ``MM_SERVE_TORCH_PROFILER_ACTIVITIES=cuda`` to keep the profiler's
own host work out of the steps (``warm_runs --profile-run``).
"""

from __future__ import annotations

import argparse
import gzip
import json

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_gaps(
    spans: list[tuple[float, float, str]],
) -> tuple[float, list[tuple[float, str, str]]]:
    """``spans``: the device's activities as (start, end, name), in one time unit. Returns
    the busy time (the union of the intervals) and the idle gaps as (length, activity that
    ended last before it, activity after it), largest first."""
    spans = sorted(spans)
    busy, gaps = 0.0, []
    start, end, name = spans[0]
    for s, e, n in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, name, n))
            start = s
        if e > end:
            end, name = e, n
    return busy + end - start, sorted(gaps, reverse=True)


def trace_spans(path: str) -> list[tuple[float, float, str]]:
    """The device activities (us) of a Chrome trace (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    ]


def print_gaps(spans: list[tuple[float, float, str]], top: int) -> None:
    """The busy and idle ms of ``spans`` (us), their gaps by size and the ``top`` largest."""
    if not spans:
        print("no device activity recorded")
        return
    busy_us, gaps = device_gaps(spans)
    span_ms = (max(e for _, e, _ in spans) - min(s for s, _, _ in spans)) / 1e3
    busy_ms = busy_us / 1e3
    print(f"device span {span_ms:.0f} ms: busy {busy_ms:.0f}, idle {span_ms - busy_ms:.0f}")
    for low, high in ((0, 10), (10, 100), (100, 1000), (1000, float("inf"))):
        inside = [g for g, _, _ in gaps if low <= g < high]
        print(f"  gaps {low}-{high} us: {len(inside):6d}, {sum(inside) / 1e3:8.1f} ms")
    for gap, before, after in gaps[:top]:
        print(f"{gap / 1e3:8.2f} ms after {before[:60]} | before {after[:60]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    for path in args.traces:
        print(f"== {path}")
        print_gaps(trace_spans(path), args.top)


if __name__ == "__main__":
    main()
