"""Where a thread's samples end, native frames included: read a py-spy ``--format raw`` profile
taken with ``--threads`` and ``--native`` and print, for the busiest threads, the innermost
named frames their samples end in and the engine's own line above each.

The engine core's main thread spins inside CUDA while it waits for the device (the step
timeline's CPU time equals its host time), so a Python-only profile shows the launch or the
read that waited, not what the driver waited on. With native frames, the innermost frame
names it: a graph launch, an event or stream synchronisation, a pinned allocation.

    python -m mm_serve.benchmarks.native_waits first_batch_stacks.txt [--threads 3] [--top 15]

``bash mm_serve/benchmarks/run_gpu.sh first-batch-stacks`` records the profile over the first
large batch after start-up.
"""

from __future__ import annotations

import argparse
import collections
import re

_COUNT = re.compile(r"^(.*) (\d+)$")


def parse(path: str) -> dict[str, collections.Counter[tuple[str, ...]]]:
    """Samples per stack, by thread: ``{thread: Counter({(outermost, ..., innermost): n})}``.
    A stack's leading ``process ...`` and ``thread ...`` elements make the thread's key."""
    threads: dict[str, collections.Counter[tuple[str, ...]]] = collections.defaultdict(
        collections.Counter
    )
    with open(path) as f:
        for line in f:
            match = _COUNT.match(line.rstrip("\n"))
            if not match:
                continue
            frames = match.group(1).split(";")
            head = [f for f in frames[:2] if f.startswith(("process", "thread"))]
            threads[" / ".join(head)][tuple(frames[len(head) :])] += int(match.group(2))
    return threads


def named_leaf(stack: tuple[str, ...]) -> str:
    """The innermost frame with a symbol name (a stripped library's frames are addresses),
    with the library of the innermost frame when that is another one."""
    named = next((f for f in reversed(stack) if not f.startswith("0x")), "?")
    library = stack[-1].rpartition(" ")[2] if stack else "?"
    return named if named.endswith(library) else f"{named} [innermost in {library}]"


def is_engine_code(location: str) -> bool:
    """Whether a file path or frame is in the engine's own code (not a benchmark's)."""
    return ("mm_serve/" in location or "kernels/" in location) and "benchmarks/" not in location


def engine_frame(stack: tuple[str, ...]) -> str:
    """The innermost frame of the engine's own code in ``stack``, or ``?``."""
    return next((frame for frame in reversed(stack) if is_engine_code(frame)), "?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--threads", type=int, default=3, help="busiest threads to show")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    threads = parse(args.profile)
    busiest = sorted(threads.items(), key=lambda kv: -sum(kv[1].values()))[: args.threads]
    for name, stacks in busiest:
        total = sum(stacks.values())
        print(f"\n{name}: {total} samples")
        leaves: collections.Counter[tuple[str, str]] = collections.Counter()
        for stack, count in stacks.items():
            leaves[(named_leaf(stack), engine_frame(stack))] += count
        for (leaf, caller), count in leaves.most_common(args.top):
            print(f"  {100 * count / total:5.1f}%  {leaf}\n          from {caller}")


if __name__ == "__main__":
    main()
