"""The front end's view of a streamed request: per-completion state and its statistics.

``StreamedCompletion`` turns engine outputs into deltas for the client (holding back text that
may still become a stop string); ``RequestStats`` records how a completion went, for metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from mm_serve.frontend.output_processor import ParentRequest, RequestState
from mm_serve.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from mm_serve.sampling_params import SamplingParams


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


class StreamedCompletion:
    """One engine request as the client sees it: what was generated and what was sent.

    Text that could still turn out to be the start of a stop string is held back until it
    cannot (or the completion ends), so that streamed text is never taken back.
    """

    def __init__(self, tokenizer, parent: ParentRequest, index: int, params: SamplingParams):
        self.state = RequestState(tokenizer, parent, index, params)
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.first_token_time: float | None = None
        self.finish_sent = False
        stops = params.stop if not params.include_stop_str_in_output else []
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def update(self, output: EngineCoreOutput, now: float) -> bool:
        """Take one engine output; True when a stop string ended the text (abort the engine
        request: it does not know)."""
        if output.new_token_ids and self.first_token_time is None:
            self.first_token_time = now
        stop_string = self.state.update(output)
        self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        if stop_string is not None:
            stopped_here = output.finish_reason is None
            self.finish_reason, self.stop_reason = "stop", stop_string
            return stopped_here
        return False

    def take_delta(self) -> CompletionOutput | None:
        """New text, tokens and logprobs since the last call; None when there is nothing."""
        text = self.state.detokenizer.text
        end = len(text) if self.finish_reason else len(text) - self.holdback
        end = max(end, self.num_sent_chars)
        token_ids = self.state.token_ids
        news = end > self.num_sent_chars or len(token_ids) > self.num_sent_tokens
        if not news and (self.finish_reason is None or self.finish_sent):
            return None
        logprobs = self.state.logprobs
        delta = CompletionOutput(
            index=self.state.index,
            text=text[self.num_sent_chars : end],
            token_ids=token_ids[self.num_sent_tokens :],
            cumulative_logprob=self.state.cumulative_logprob,
            logprobs=None if logprobs is None else logprobs[self.num_sent_tokens :],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.num_sent_chars, self.num_sent_tokens = end, len(token_ids)
        self.finish_sent = self.finish_reason is not None
        return delta


def request_output(
    parent: ParentRequest,
    deltas: list[CompletionOutput],
    completions: dict[str, StreamedCompletion],
) -> RequestOutput:
    """A request's streamed output: ``deltas`` of this update, finished once every completion
    is."""
    return RequestOutput(
        request_id=parent.request_id,
        prompt=parent.prompt,
        prompt_token_ids=parent.prompt_token_ids,
        prompt_logprobs=None,
        outputs=deltas,
        finished=all(c.finish_reason is not None for c in completions.values()),
        num_cached_tokens=parent.num_cached_tokens,
        num_cached_images=parent.num_cached_images,
    )
