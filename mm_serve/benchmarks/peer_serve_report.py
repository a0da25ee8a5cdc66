"""The report of ``peer_serve``: vLLM bench-serve result JSONs -> table, verdicts, cold start.

Reads ``DIR/ENGINE_RATE.json`` (``vllm bench serve --save-result --save-detailed``) and
``DIR/ENGINE_server.json`` (the server's start-up time or error); ``build_report`` gathers every
engine with results there, ``format_report`` prints verdicts, cold start and the table.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import numpy as np

# Our row's names for the fields of vLLM 0.33's bench-serve result JSON (vllm/benchmarks/
# serve.py); it also has per request, in request order, "ttfts" (s) and "errors" ("": success).
RESULT_FIELDS = {
    "completed": "completed",
    "failed": "failed",
    "ttft_median_ms": "median_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "tpot_median_ms": "median_tpot_ms",
    "itl_p99_ms": "p99_itl_ms",
    "output_tok_s": "output_throughput",
}
VERDICT_METRICS = ("ttft_median_ms", "ttft_p99_ms", "tpot_median_ms")
# The table's columns after engine and rate: title, summarize_run key, format.
TABLE = [
    ("done", "completed", "d"),
    ("failed", "failed", "d"),
    ("TTFT med", "ttft_median_ms", ".1f"),
    ("TTFT p99", "ttft_p99_ms", ".1f"),
    ("TPOT med", "tpot_median_ms", ".2f"),
    ("ITL p99", "itl_p99_ms", ".1f"),
    ("out tok/s", "output_tok_s", ".0f"),
]
COLD_START_WINDOW = 32  # requests
COLD_START_LIMIT = 1.5  # acceptance: first-window TTFT median <= 1.5x the next window's


class ResultFormatError(ValueError):
    """A bench-serve result JSON lacks a field this report reads."""


def log_tail(path: str, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file ("" when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def result_filename(engine: str, rate: float) -> str:
    return f"{engine}_{rate:g}.json"


def load_result(path: str) -> dict[str, Any]:
    """A bench-serve result JSON, checked for the fields read here.

    Raises:
        ResultFormatError: a field is missing (names the fields and the file).
    """
    with open(path) as f:
        result = json.load(f)
    missing = [f for f in [*RESULT_FIELDS.values(), "ttfts", "errors"] if f not in result]
    if missing:
        raise ResultFormatError(
            f"{path} lacks {', '.join(missing)}: expected vLLM 0.33's `bench serve` result "
            "JSON written with --save-result --save-detailed."
        )
    return result


def summarize_run(result: dict[str, Any]) -> dict[str, float]:
    """One row of the table: counts, latencies (ms) and output tokens/s of one run."""
    return {ours: result[theirs] for ours, theirs in RESULT_FIELDS.items()}


def cold_start(result: dict[str, Any], window: int = COLD_START_WINDOW) -> dict[str, Any]:
    """TTFT median (ms) of requests ``[0, window)`` against ``[window, 2 * window)`` in request
    order, over the successful ones; ``ratio`` is first / next (None when a window has no
    successful request), ``passed`` whether it is <= ``COLD_START_LIMIT``.

    Raises:
        ValueError: the run has fewer than ``2 * window`` requests.
    """
    ttfts, errors = result["ttfts"], result["errors"]
    if len(ttfts) < 2 * window:
        raise ValueError(f"cold start needs {2 * window} requests; the run has {len(ttfts)}")
    medians = []
    for start in (0, window):
        ok = [ttfts[i] for i in range(start, start + window) if not errors[i]]
        medians.append(float(np.median(ok)) * 1000 if ok else None)
    first, following = medians
    ratio = first / following if first is not None and following else None
    return {
        "window": window,
        "first_median_ms": first,
        "next_median_ms": following,
        "ratio": ratio,
        "passed": ratio is not None and ratio <= COLD_START_LIMIT,
    }


def verdicts(runs: dict[str, dict[str, dict]]) -> list[dict[str, Any]]:
    """Per rate both engines ran: whether mm_serve had no failed request, and per
    ``VERDICT_METRICS`` whether mm_serve <= vLLM. ``runs`` maps engine -> rate (as in the file
    name) -> ``summarize_run`` row."""
    out = []
    for rate, ours in runs.get("mm_serve", {}).items():
        peer = runs.get("vllm", {}).get(rate)
        for metric in ("failed", *VERDICT_METRICS) if peer else ():
            passed = ours["failed"] == 0 if metric == "failed" else ours[metric] <= peer[metric]
            values = {"mm_serve": ours[metric], "vllm": peer[metric], "passed": passed}
            out.append({"rate": rate, "metric": metric, **values})
    return out


def build_report(out_dir: str, engines: list[str], rates: list[float]) -> dict[str, Any]:
    """The report from the result JSONs in ``out_dir`` (missing runs and engines are left out)
    and each engine's ``ENGINE_server.json`` (server command, start-up time, error). The cold start
    comes from the first rate's run when it has ``2 * COLD_START_WINDOW`` requests."""
    report: dict[str, Any] = {"engines": {}}
    runs: dict[str, dict[str, dict]] = {}
    for engine in engines:
        info: dict[str, Any] = {}
        info_path = os.path.join(out_dir, f"{engine}_server.json")
        if os.path.exists(info_path):
            with open(info_path) as f:
                info = json.load(f)
        runs[engine] = {}
        for i, rate in enumerate(rates):
            path = os.path.join(out_dir, result_filename(engine, rate))
            if not os.path.exists(path):
                continue
            result = load_result(path)
            runs[engine][f"{rate:g}"] = summarize_run(result)
            if i == 0 and len(result["ttfts"]) >= 2 * COLD_START_WINDOW:
                info["cold_start"] = cold_start(result)
                # With --ready-check-timeout-sec > 0 one test request goes first (and warms up).
                bench_log = log_tail(path.replace(".json", ".log"), lines=10_000)
                info["cold_start"]["after_test_request"] = "Initial test run completed" in bench_log
        if info or runs[engine]:
            report["engines"][engine] = {**info, "runs": runs[engine]}
    report["verdicts"] = verdicts(runs)
    return report


def format_report(report: dict[str, Any]) -> str:
    """Verdicts and cold starts, then the table (last)."""
    lines = []
    for v in report["verdicts"]:
        failed = v["metric"] == "failed"
        rule, spec = ("mm_serve has none", "8d") if failed else ("mm_serve <= vLLM", "8.2f")
        lines.append(
            f"{v['rate']:>4} req/s {v['metric']:<15} mm_serve {v['mm_serve']:{spec}}  "
            f"vLLM {v['vllm']:{spec}}  {rule}: {'yes' if v['passed'] else 'NO'}"
        )
    for engine, info in report["engines"].items():
        if "error" in info:
            error = info["error"].strip().splitlines()
            lines.append(f"{engine} FAILED: {error[0]} ... {error[-1]}")
        if info.get("server_exit_code") == -signal.SIGKILL:
            lines.append(f"{engine} server ignored SIGTERM: killed after --shutdown-timeout")
        cold = info.get("cold_start")
        if cold and cold["ratio"] is not None:
            n = cold["window"]
            lines.append(
                f"cold start {engine}: TTFT median of requests 1-{n} "
                f"{cold['first_median_ms']:.1f} ms, {n + 1}-{2 * n} {cold['next_median_ms']:.1f} "
                f"ms: {cold['ratio']:.2f}x (<= {COLD_START_LIMIT}x: "
                f"{'yes' if cold['passed'] else 'NO'})"
                + (" after one test request" if cold.get("after_test_request") else "")
            )
    lines.append(f"{'engine':<9}{'req/s':>6}" + "".join(f"{t:>10}" for t, _, _ in TABLE))
    for engine, info in report["engines"].items():
        for rate, r in info["runs"].items():
            cells = "".join(f"{r[key]:>10{spec}}" for _, key, spec in TABLE)
            lines.append(f"{engine:<9}{rate:>6}{cells}")
    return "\n".join(lines)


# ---------------------------------------------------------------- main
