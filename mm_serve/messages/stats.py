"""Counters of one engine, readable at any time (``LLM.get_stats()``, ``/metrics``), and how
each completion went (``RequestTimes`` as it runs, ``RequestStats`` once it finished, for the
server's metrics).

Counts are cumulative since start-up; gauges (running, waiting, KV usage) are the current
values. Prefix-cache counts are in tokens, encoder-cache counts in images (one query per
image a request needs, the first time its placeholder range is scheduled). Times are
``time.monotonic()`` seconds: the front end and the engine core run on one host, so their
clocks agree.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mm_serve.messages.outputs import EngineCoreOutput

# Upper bounds of the iteration-tokens histogram's buckets (tokens scheduled in one step).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV was found
    encoder_cache_queries: int = 0  # images needed by a scheduled window
    encoder_cache_hits: int = 0  # of those, images whose embeddings were already cached
    encoder_tokens_computed: int = 0  # embedding tokens run through the vision encoder
    num_encoder_cache_entries: int = 0  # entries held by the encoder cache now
    encoder_cache_usage: float = 0.0  # fraction of the encoder cache referenced by requests, 0..1
    processor_cache_queries: int = 0  # images looked up in the front end's processor cache
    processor_cache_hits: int = 0  # of those, images that skipped the preprocessing pool
    # Engine steps by tokens scheduled: counts per ITERATION_TOKENS_BUCKETS bucket (not
    # cumulative; one more for +Inf), and the sum of the tokens (empty: no step yet).
    iteration_tokens_counts: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0


_MEAN_FIELDS = ("kv_cache_usage", "encoder_cache_usage")  # fractions: averaged, not summed


def combine_stats(replicas: list[EngineStats]) -> EngineStats:
    """The counters of several engine core replicas (data parallelism) as one engine's: counts
    and the step histogram summed, the cache-usage fractions averaged (the replicas' caches
    are alike in size)."""
    combined = EngineStats()
    for name in EngineStats.__dataclass_fields__:
        values = [getattr(stats, name) for stats in replicas]
        if name in _MEAN_FIELDS:
            setattr(combined, name, sum(values) / len(values))
        elif name == "iteration_tokens_counts":
            histograms = [counts for counts in values if counts]
            combined.iteration_tokens_counts = [sum(c) for c in zip(*histograms, strict=True)]
        else:
            setattr(combined, name, sum(values))
    return combined


class IterationTokens:
    """The engine's histogram of tokens scheduled per step (``EngineStats.iteration_tokens_*``)."""

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.sum = 0

    def observe(self, num_tokens: int) -> None:
        """Count one step that scheduled ``num_tokens`` tokens."""
        self.counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.sum += num_tokens

    def add_to(self, stats: EngineStats) -> EngineStats:
        """``stats`` with a copy of this histogram (left empty before the first step)."""
        if self.sum:
            stats.iteration_tokens_counts = list(self.counts)
            stats.iteration_tokens_sum = self.sum
        return stats


@dataclass
class RequestTimes:
    """When one completion reached its milestones; filled by ``record`` from its outputs.

    ``scheduled``: the engine first scheduled it; ``engine_first_token`` /
    ``engine_last_token``: the engine ended the step that made its first / latest token;
    ``first_token`` / ``last_token``: that token reached the front end.
    """

    scheduled: float | None = None
    engine_first_token: float | None = None
    engine_last_token: float | None = None
    first_token: float | None = None
    last_token: float | None = None

    def record(self, output: EngineCoreOutput, now: float) -> float | None:
        """Take one engine output of the completion, which reached the front end at ``now``;
        returns the inter-token latency (ITL: seconds since the previous output with tokens)
        when it has tokens and is not the first with some, else None."""
        if output.scheduled_time is not None:
            self.scheduled = output.scheduled_time
        if not output.new_token_ids:
            return None
        latency = None if self.last_token is None else now - self.last_token
        if self.first_token is None:
            self.first_token, self.engine_first_token = now, output.timestamp
        self.last_token, self.engine_last_token = now, output.timestamp
        return latency


def _interval(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass
class RequestStats:
    """How one completion (one of a request's ``n``) went; times are ``time.monotonic()``
    seconds, durations seconds (None when a milestone was not reached).

    ``index``: the completion's place among the request's ``n`` (0 for the first);
    ``finish_reason``: "stop" or "length" (the engine's), "abort" (cancelled: the client went
    away) or "error" (the engine refused the request or died).
    """

    index: int
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float
    finished_time: float
    times: RequestTimes = field(default_factory=RequestTimes)
    request_id: str = ""  # the request's (its completions share it)

    @property
    def ttft(self) -> float | None:
        """Time to first token (TTFT): arrival to the first output token reaching the front
        end."""
        return _interval(self.arrival_time, self.times.first_token)

    @property
    def e2e_latency(self) -> float:
        """End-to-end latency: arrival to the last output."""
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token (TPOT) after the first one; None with fewer than two tokens."""
        first_token = self.times.first_token
        if first_token is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - first_token) / (self.num_output_tokens - 1)

    @property
    def queue_time(self) -> float | None:
        """Arrival to the engine's first scheduling of the completion."""
        return _interval(self.arrival_time, self.times.scheduled)

    @property
    def prefill_time(self) -> float | None:
        """First scheduled to the end of the engine step that made the first token."""
        return _interval(self.times.scheduled, self.times.engine_first_token)

    @property
    def decode_time(self) -> float | None:
        """The engine's first token to its last token."""
        return _interval(self.times.engine_first_token, self.times.engine_last_token)

    @property
    def inference_time(self) -> float | None:
        """First scheduled to the engine's last token (prefill and decode)."""
        return _interval(self.times.scheduled, self.times.engine_last_token)
