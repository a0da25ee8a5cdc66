"""Output processing, offline and streamed: engine outputs in, ``RequestOutput``s out.

One ``RequestState`` per engine request accumulates its tokens and logprobs, detokenizes them
incrementally and ends the text at a stop string (the engine core does not know stop strings:
``OutputProcessor.process_outputs`` returns the requests it must abort). A ``ParentRequest`` is
the user's request; with ``n > 1`` its ``n`` engine requests (its children) merge into one
``RequestOutput``: whole once every child finished (the offline ``LLM``), or with ``stream``
a delta of each child's news after each batch of outputs (``AsyncLLM``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mm_serve.frontend.detokenizer import IncrementalDetokenizer
from mm_serve.messages.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    EngineCoreOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
)
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.messages.stats import RequestTimes


@dataclass
class ParentRequest:
    """A user request; with ``n > 1`` it fans out into ``n`` engine requests (its children).

    ``stream``: its outputs are deltas (see ``RequestState.take_delta``), else one whole output
    once every child finished. ``pooling``: an embedding request (one child), whose one output
    is an ``EmbeddingRequestOutput``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_children: int
    stream: bool = False
    children: list[RequestState] = field(default_factory=list)  # in index order
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False  # streamed: with the first output that has tokens
    num_cached_tokens: int = 0
    num_cached_images: int = 0
    pooling: bool = False

    @property
    def finished(self) -> bool:
        """Every child was added and has finished."""
        children = self.children
        return len(children) == self.num_children and all(c.finished for c in children)

    def record_cache_hits(self, index: int, output: EngineCoreOutput) -> None:
        """Cached prompt tokens: the most any child got. Cached images: those of the first child,
        as its siblings (added after it) may reuse the embeddings it computes."""
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if index == 0:
            self.num_cached_images = max(self.num_cached_images, output.num_cached_images)

    def make_output(self) -> RequestOutput | EmbeddingRequestOutput | None:
        """Whole: the final output once every child finished, else None. Streamed: the children's
        deltas (None when none has news); ``finished`` on the last one."""
        if self.pooling:
            if not self.finished:
                return None
            embedding = EmbeddingOutput(self.children[0].embedding or [])
            return EmbeddingRequestOutput(self.request_id, embedding, self.prompt_token_ids)
        if self.stream:
            completions = [d for c in self.children if (d := c.take_delta()) is not None]
            prompt_logprobs = None
            if completions and not self.prompt_logprobs_sent:  # complete once tokens come
                prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        elif self.finished:
            completions = [c.completion() for c in self.children]
            prompt_logprobs = self.prompt_logprobs
        else:
            return None
        if not completions:
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            num_cached_images=self.num_cached_images,
        )


class RequestState:
    """One engine request's accumulated output, and (streamed) what of it was sent.

    ``times``: when its milestones came (for the metrics: TTFT, ITL, queue and prefill time).
    """

    def __init__(self, tokenizer, parent: ParentRequest, index: int, params: SamplingParams):
        self.parent = parent
        self.index = index
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        # A whole output's text is read once it is finished: decoded then from token_ids.
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, parent.prompt_token_ids, params, None if parent.stream else self.token_ids
        )
        self.logprobs = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.embedding: list[float] | None = None  # a pooling request's, as it finishes
        self.times = RequestTimes()
        # Streaming: what was sent, and how much text to hold back while it may still become
        # the start of a stop string (streamed text is never taken back).
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        self.finish_sent = False
        stops = params.stop if not params.include_stop_str_in_output else []
        self.holdback = max((len(s) for s in stops), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> bool:
        """Take one step's output; True when a stop string ended the text while the engine
        request runs on (abort it: the engine core does not know stop strings)."""
        self.token_ids.extend(output.new_token_ids)
        for entry in output.new_logprobs or []:
            self.logprobs.append(self._to_logprob_dict(entry))
            self.cumulative_logprob += entry[1][0]
        for entry in output.new_prompt_logprobs or []:
            self.prompt_logprobs.append(self._to_logprob_dict(entry))
        if output.pooling_output is not None:
            self.embedding = output.pooling_output
        stop_string = self.detokenizer.update(output.new_token_ids)
        self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        if stop_string is None:
            return False
        self.finish_reason, self.stop_reason = "stop", stop_string
        return output.finish_reason is None

    def _to_logprob_dict(self, entry: tuple[list[int], list[float], int]) -> dict[int, Logprob]:
        """Column 0 is the chosen token with its rank; the rest are the top-k, rank 1.."""
        token_ids, logprobs, rank = entry
        top = zip(token_ids[1:], logprobs[1:], strict=True)
        result = {
            token_id: Logprob(value, rank=k, decoded_token=self.tokenizer.decode([token_id]))
            for k, (token_id, value) in enumerate(top, start=1)
        }
        result.setdefault(
            token_ids[0],
            Logprob(logprobs[0], rank=rank, decoded_token=self.tokenizer.decode([token_ids[0]])),
        )
        return result

    def completion(self, text: str | None = None, start: int = 0) -> CompletionOutput:
        """Everything so far; or ``text`` and the tokens and logprobs from ``start`` on."""
        logprobs = self.logprobs
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.text if text is None else text,
            token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if logprobs is None else logprobs[start:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def take_delta(self) -> CompletionOutput | None:
        """New text, tokens and logprobs since the last call (the ``cumulative_logprob`` is the
        running total); once more with the finish reason; None when there is nothing new."""
        text = self.detokenizer.text
        end = len(text) if self.finished else len(text) - self.holdback
        end = max(end, self.num_sent_chars)
        token_ids = self.token_ids
        news = end > self.num_sent_chars or len(token_ids) > self.num_sent_tokens
        if not news and (not self.finished or self.finish_sent):
            return None
        delta = self.completion(text[self.num_sent_chars : end], self.num_sent_tokens)
        self.num_sent_chars, self.num_sent_tokens = end, len(token_ids)
        self.finish_sent = self.finished
        return delta


class OutputProcessor:
    """Turns ``EngineCoreOutput``s into ``RequestOutput``s, for the offline ``LLM`` (whole
    outputs) and ``AsyncLLM`` (streamed deltas) alike; the parent request says which.

    ``on_inter_token_latency``: called with each inter-token latency (ITL, seconds; see
    ``RequestTimes.record``), for the metrics; None: not measured.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.on_inter_token_latency: Callable[[float], None] | None = None

    def add_request(
        self, engine_request_id: str, parent: ParentRequest, index: int, params: SamplingParams
    ) -> RequestState:
        """Track engine request ``engine_request_id``, child ``index`` of ``parent``."""
        state = RequestState(self.tokenizer, parent, index, params)
        parent.children.append(state)
        self.states[engine_request_id] = state
        return state

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], now: float = 0.0
    ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[str]]:
        """Returns the request outputs these engine outputs make (see
        ``ParentRequest.make_output``), and the engine requests to abort (stop strings).
        ``now``: the outputs' arrival time (``time.monotonic()``), for ``RequestState.times``."""
        parents: dict[int, ParentRequest] = {}  # by id(): in order, each once
        to_abort: list[str] = []
        for output in outputs:
            state = self.states.get(output.request_id)
            if state is None:
                continue  # aborted, or ended by a stop string: its last outputs are moot
            latency = state.times.record(output, now)
            if latency is not None and self.on_inter_token_latency is not None:
                self.on_inter_token_latency(latency)
            if state.update(output):
                to_abort.append(output.request_id)
            parent = state.parent
            if output.num_cached_tokens or output.num_cached_images:
                parent.record_cache_hits(state.index, output)
            if state.prompt_logprobs is not None and state.index == 0:
                parent.prompt_logprobs = state.prompt_logprobs
            finished = state.finished
            if finished:
                del self.states[output.request_id]
            if finished or parent.stream:  # a whole output needs every child finished
                parents[id(parent)] = parent
        request_outputs = [o for p in parents.values() if (o := p.make_output()) is not None]
        return request_outputs, to_abort

    def abort_requests(self, engine_request_ids: list[str]) -> None:
        """Stop tracking these engine requests (unknown ids are ignored)."""
        for req_id in engine_request_ids:
            self.states.pop(req_id, None)
