"""Counters of one engine, readable at any time (``LLM.get_stats()``, ``/metrics``), and how
each completion went (``RequestStats``, for the server's metrics).

Counts are cumulative since start-up; gauges (running, waiting, KV usage) are the current
values. Prefix-cache counts are in tokens, encoder-cache counts in images (one query per
image a request needs, the first time its placeholder range is scheduled).
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass
class RequestStats:
    """How one completion (one of a request's ``n``) went; times are ``time.monotonic()``
    seconds.

    ``index``: the completion's place among the request's ``n`` (0 for the first);
    ``finish_reason``: "stop" or "length" (the engine's), "abort" (cancelled: the client went
    away) or "error" (the engine refused the request or died).
    """

    index: int
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float
    first_token_time: float | None
    finished_time: float

    @property
    def ttft(self) -> float | None:
        """Time to first token (s): arrival to the first output token reaching the front end."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        """End-to-end latency (s): arrival to the last output."""
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token (s) after the first one; None with fewer than two tokens."""
        if self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)
