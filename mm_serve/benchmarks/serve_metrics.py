"""Statistics, table and plot for ``mm-serve bench serve`` (see ``serve.py``).

Pure functions over per-request timings, so they can be tested on hand-made numbers. Terms:

- TTFT: time to first token, from sending the request to its first content chunk.
- ITL: inter-token latency, the gap between consecutive content chunks of one request (a chunk
  may carry several tokens, so ITL is per chunk, as in ``vllm bench serve``).
- TPOT: time per output token after the first, ``(e2e - TTFT) / (output_tokens - 1)``, one
  value per request with more than one output token.
- e2e latency: from sending the request to the end of its stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to first token (TTFT)",
    "tpot": "Time per output token (TPOT, excl. 1st)",
    "itl": "Inter-token latency (ITL)",
    "e2el": "End-to-end latency (e2e)",
}


@dataclass
class RequestResult:
    """The outcome of one benchmark request; all times in seconds.

    ``itl_s`` holds the gaps between consecutive content chunks; ``start_s`` is when the
    request was sent, after the run's start. ``error`` is empty on success and holds the
    reason (HTTP status and message, connection error, error event) otherwise.
    """

    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    start_s: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (output_tokens - 1) in s; None with fewer than 2 output tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``.

    Raises:
        ValueError: a value is not a number in [0, 100].
    """
    message = f"Percentiles must be numbers in [0, 100], got {text!r}."
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(message) from error
    if not values or any(not 0 <= value <= 100 for value in values):
        raise ValueError(message)
    return values


def _percentile_key(p: float) -> str:
    return f"p{p:g}"


def latency_stats(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    """Mean, median, std and ``percentiles`` of ``values_s`` (seconds) as ``{stat}_{name}_ms``
    keys in milliseconds (``vllm bench serve``'s names); all 0.0 when there are no values."""
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if values_ms.size == 0:
        values_ms = np.zeros(1)
    stats = {
        f"mean_{name}_ms": float(values_ms.mean()),
        f"median_{name}_ms": float(np.median(values_ms)),
        f"std_{name}_ms": float(values_ms.std()),
    }
    for p in percentiles:
        stats[f"{_percentile_key(p)}_{name}_ms"] = float(np.percentile(values_ms, p))
    return stats


def metric_values(results: list[RequestResult]) -> dict[str, list[float]]:
    """Per-metric samples in seconds over the successful requests (ITL pooled over them)."""
    done = [r for r in results if r.success]
    return {
        "ttft": [r.ttft_s for r in done],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.e2e_s for r in done],
    }


def summarize(
    results: list[RequestResult], duration_s: float, percentiles: list[float], max_errors: int = 5
) -> dict:
    """The benchmark's result dict: counts, throughputs (per second of ``duration_s``, the
    wall time from the first send to the last response) and latency stats in ms.

    Token counts and throughputs count successful requests only. ``errors`` keeps the first
    ``max_errors`` error texts; the per-request lists (``ttfts``, ``e2els`` in s, ...) follow
    the order of ``results`` and hold 0 / empty for failed requests; ``start_times`` (s after
    the first send) holds every request's send time.
    """
    done = [r for r in results if r.success]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) * per_second,
        "output_throughput": output_tokens * per_second,
        "total_token_throughput": (prompt_tokens + output_tokens) * per_second,
        "percentiles": percentiles,
    }
    for name, values in metric_values(results).items():
        summary.update(latency_stats(name, values, percentiles))
    summary["errors"] = [r.error for r in results if not r.success][:max_errors]
    summary["input_lens"] = [r.prompt_tokens for r in results]
    summary["output_lens"] = [r.output_tokens for r in results]
    summary["ttfts"] = [r.ttft_s for r in results]
    summary["e2els"] = [r.e2e_s for r in results]
    summary["itls"] = [r.itl_s for r in results]
    summary["start_times"] = [r.start_s for r in results]
    return summary


def format_table(summary: dict) -> str:
    """A readable report of ``summarize``'s dict, in the layout of ``vllm bench serve``."""
    width = 50
    rows = [
        ("Successful requests:", summary["completed"]),
        ("Failed requests:", summary["failed"]),
        ("Benchmark duration (s):", summary["duration_s"]),
        ("Total input tokens:", summary["total_input_tokens"]),
        ("Total generated tokens:", summary["total_output_tokens"]),
        ("Request throughput (req/s):", summary["request_throughput"]),
        ("Output token throughput (tok/s):", summary["output_throughput"]),
        ("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="=")]
    lines += [_row(label, value) for label, value in rows]
    for name in METRICS:
        lines.append("{s:{c}^{n}}".format(s=f" {METRIC_TITLES[name]} ", n=width, c="-"))
        lines.append(_row(f"Mean {name.upper()} (ms):", summary[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {name.upper()} (ms):", summary[f"median_{name}_ms"]))
        lines.append(_row(f"Std {name.upper()} (ms):", summary[f"std_{name}_ms"]))
        for p in summary["percentiles"]:
            key = _percentile_key(p)
            lines.append(_row(f"P{p:g} {name.upper()} (ms):", summary[f"{key}_{name}_ms"]))
    for error in summary["errors"]:
        lines.append(f"Error: {error}")
    lines.append("=" * width)
    return "\n".join(lines)


def _row(label: str, value: float | int) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{text:>10}"


def plot_latencies(results: list[RequestResult], path: str) -> bool:
    """Write a PNG with one histogram per metric (TTFT, TPOT, ITL, e2e; ms) to ``path``.

    Returns False (and logs why) when matplotlib is not installed; matplotlib is imported
    here, not at module import, because GPU hosts may lack it.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed: skipping the plot %s.", path)
        return False
    figure = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(figure)  # the Agg backend, without pyplot's global state
    axes = figure.subplots(2, 2).ravel()
    for ax, (name, values_s) in zip(axes, metric_values(results).items(), strict=True):
        values_ms = np.asarray(values_s) * 1000.0
        ax.set_title(METRIC_TITLES[name])
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        if values_ms.size == 0:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist(values_ms, bins=min(50, max(5, values_ms.size // 2)), color="tab:blue")
        median = float(np.median(values_ms))
        ax.axvline(median, color="tab:red", linestyle="--", label=f"median {median:.1f} ms")
        ax.legend(loc="upper right")
    figure.suptitle(f"Latency distributions ({sum(r.success for r in results)} requests)")
    figure.savefig(path, format="png", dpi=100)
    return True
