"""Front-end side of a request: accumulate tokens, detokenize, logprobs, stop strings, n > 1."""

from __future__ import annotations

from dataclasses import dataclass, field

from mm_serve.frontend.detokenizer import IncrementalDetokenizer
from mm_serve.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
)
from mm_serve.sampling_params import SamplingParams


@dataclass
class ParentRequest:
    """A user request; with ``n > 1`` it fans out into ``n`` engine requests (its children)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_children: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    num_cached_images: int = 0

    def record_cache_hits(self, index: int, output: EngineCoreOutput) -> None:
        """Cached prompt tokens: the most any child got. Cached images: those of the first child,
        as its siblings (added after it) may reuse the embeddings it computes."""
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if index == 0:
            self.num_cached_images = max(self.num_cached_images, output.num_cached_images)


class RequestState:
    """One engine request's accumulated output."""

    def __init__(self, tokenizer, parent: ParentRequest, index: int, params: SamplingParams):
        self.parent = parent
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, parent.prompt_token_ids, params)
        self.token_ids: list[int] = []
        self.logprobs = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None

    def update(self, output: EngineCoreOutput) -> str | None:
        """Take one step's output; return the stop string if one ended the text."""
        self.token_ids.extend(output.new_token_ids)
        for entry in output.new_logprobs or []:
            self.logprobs.append(self._to_logprob_dict(entry))
            self.cumulative_logprob += entry[1][0]
        for entry in output.new_prompt_logprobs or []:
            self.prompt_logprobs.append(self._to_logprob_dict(entry))
        return self.detokenizer.update(output.new_token_ids)

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

    def completion(self, finish_reason: str | None, stop_reason) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )


class OutputProcessor:
    """Turns ``EngineCoreOutput``s into finished ``RequestOutput``s.

    Stop strings are found here, after detokenization; the engine core is then told to abort
    those requests (``process_outputs`` returns their ids).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self, engine_request_id: str, parent: ParentRequest, index: int, params: SamplingParams
    ) -> None:
        self.states[engine_request_id] = RequestState(self.tokenizer, parent, index, params)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the user requests that finished and the engine requests to abort."""
        finished: list[RequestOutput] = []
        to_abort: list[str] = []
        for output in outputs:
            state = self.states.get(output.request_id)
            if state is None:
                continue
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            stop_string = state.update(output)
            if stop_string is not None and finish_reason is None:
                finish_reason, stop_reason = "stop", stop_string
                to_abort.append(output.request_id)
            elif stop_string is not None:
                finish_reason, stop_reason = "stop", stop_string
            parent = state.parent
            if state.prompt_logprobs is not None and state.index == 0:
                parent.prompt_logprobs = state.prompt_logprobs
            if finish_reason is None:
                continue
            del self.states[output.request_id]
            parent.record_cache_hits(state.index, output)
            parent.completions[state.index] = state.completion(finish_reason, stop_reason)
            if len(parent.completions) == parent.num_children:
                finished.append(_request_output(parent))
        return finished, to_abort

    def abort_requests(self, engine_request_ids: list[str]) -> None:
        for req_id in engine_request_ids:
            self.states.pop(req_id, None)


def _request_output(parent: ParentRequest) -> RequestOutput:
    return RequestOutput(
        request_id=parent.request_id,
        prompt=parent.prompt,
        prompt_token_ids=parent.prompt_token_ids,
        prompt_logprobs=parent.prompt_logprobs,
        outputs=[parent.completions[i] for i in sorted(parent.completions)],
        finished=True,
        num_cached_tokens=parent.num_cached_tokens,
        num_cached_images=parent.num_cached_images,
    )
