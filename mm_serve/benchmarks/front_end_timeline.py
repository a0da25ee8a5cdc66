"""The offline front end's side of each ``LLM.generate`` call, beside the engine's step timeline.

``LLM.generate`` runs in the front end's process: it adds each request once the preprocessing
pool has its images, and takes the engine core's outputs (``engine_core.step()``) through the
output processor. Its time outside the engine's steps (before the first, after the last) and a
backlog of outputs (the front end falling behind the decode steps) add to a batch's time
without showing in the step timeline (``engine/step_timeline.py``). Record both:

    MM_SERVE_STEP_TIMELINE=tl.jsonl python -m mm_serve.benchmarks.front_end_timeline \\
        --record fe.jsonl bench throughput ...        # any ``mm-serve`` command after the file
    python -m mm_serve.benchmarks.front_end_timeline --summary fe.jsonl tl.jsonl

``--record`` appends one JSON line per ``generate`` call: its start and end, when each request
was added, and per ``engine_core.step()`` call its start, end, output count and the seconds of
``process_outputs`` (``time.perf_counter()``, the clock of the step timeline). ``--summary``
prints, per call, the time from its start to the engine's first step and from the engine's
last step to its return, when the last request was added, and the largest batch of outputs
one ``step()`` returned (over the batch size: the front end fell behind).
"""

from __future__ import annotations

import argparse
import json
import time

from mm_serve.benchmarks.step_timeline import load_runs


def record(path: str, cli_args: list[str]) -> int:
    """Run the ``mm-serve`` command ``cli_args`` with ``LLM._run_engine`` recorded to ``path``."""
    from mm_serve.entrypoints import cli
    from mm_serve.entrypoints.llm import LLM

    run_engine = LLM._run_engine

    def recorded(self, prompts, sampling_params, added, use_tqdm):
        call = {"start": time.perf_counter(), "adds": [], "steps": []}
        core, processor = self.engine_core, self.output_processor
        step, process, add = core.step, processor.process_outputs, self._add_request

        def timed_step():
            start = time.perf_counter()
            outputs = step()
            call["steps"].append([start, time.perf_counter(), len(outputs), 0.0])
            return outputs

        def timed_process(outputs, *args):
            start = time.perf_counter()
            result = process(outputs, *args)
            call["steps"][-1][3] = time.perf_counter() - start
            return result

        def timed_add(*args):
            call["adds"].append(time.perf_counter())
            return add(*args)

        core.step, processor.process_outputs, self._add_request = (
            timed_step, timed_process, timed_add
        )  # fmt: skip
        try:
            return run_engine(self, prompts, sampling_params, added, use_tqdm)
        finally:  # (``step`` may be the step timeline's wrapper: put back, not deleted)
            core.step, processor.process_outputs, self._add_request = step, process, add
            call["end"] = time.perf_counter()
            with open(path, "a") as f:
                f.write(json.dumps(call) + "\n")

    LLM._run_engine = recorded
    return cli.main(cli_args)


def summarise(call: dict, steps: list[dict] | None, run: int | None = None) -> str:
    """One line of a ``generate`` call's record, with its engine run's step records (or None)
    and that run's index in the step timeline (``step_timeline --run``)."""
    ms = lambda t: (t - call["start"]) * 1e3  # noqa: E731
    line = f"generate {(call['end'] - call['start']) * 1e3:7.1f} ms"
    if call["adds"]:
        first, last = ms(call["adds"][0]), ms(call["adds"][-1])
        line += f" | {len(call['adds'])} requests added {first:.1f}-{last:.1f} ms"
    if steps:
        tail = (call["end"] - steps[-1]["t1"]) * 1e3
        line += f" | engine steps {ms(steps[0]['t0']):.1f}-{ms(steps[-1]['t1']):.1f} ms"
        line += f" (return {tail:.1f} ms after; step timeline run {run})"
    most = max((s[2] for s in call["steps"]), default=0)
    processing = sum(s[3] for s in call["steps"]) * 1e3
    return line + f" | outputs: at most {most} per step(), {processing:.0f} ms to process"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="FILE", help="then the mm-serve command's arguments")
    mode.add_argument("--summary", nargs=2, metavar=("FILE", "STEP_TIMELINE"))
    args, rest = parser.parse_known_args()
    if args.record:
        raise SystemExit(record(args.record, rest))
    with open(args.summary[0]) as f:
        calls = [json.loads(line) for line in f]
    runs = load_runs(args.summary[1])
    for call in calls:  # the engine run whose steps began inside the call
        inside = (i for i, r in enumerate(runs) if call["start"] <= r[0]["t0"] <= call["end"])
        run = next(inside, None)
        print(summarise(call, None if run is None else runs[run], run))


if __name__ == "__main__":
    main()
