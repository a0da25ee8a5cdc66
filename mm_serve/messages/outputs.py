"""What the engine produces: each step's ``EngineCoreOutput`` per request (engine core →
front end), and the ``RequestOutput`` the front end assembles from them (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass
class Logprob:
    """Log-probability of one token; ``rank`` 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the chosen token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt: its ``n`` completions and, if asked, its prompt logprobs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # Prompt images whose embeddings were not computed for it: found in the encoder cache, or
    # their whole placeholder range in the prefix cache.
    num_cached_images: int = 0


@dataclass
class EmbeddingOutput:
    """The embedding of one prompt (vLLM's): float32 values, ``hidden_size`` of them unless
    truncated (``PoolingParams.dimensions``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of one embedding request (vLLM's, ``LLM.embed``): ``outputs.embedding``."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


# One position's log-probs: (token ids: the sampled token, then the top-k; their log-probs;
# the rank of the sampled token).
LogprobsEntry = tuple[list[int], list[float], int]


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """New tokens of one engine request after a step, for the front end (detokenizer, stop
    strings): one ``LogprobsEntry`` per new token in ``new_logprobs``, per prompt position in
    ``new_prompt_logprobs``. The engine core process sends it as it is: msgspec encodes it as
    an array of its fields. A step makes one per request, so it is a Struct, which is built,
    encoded and decoded several times faster than a dataclass; it never holds a reference
    cycle, so the garbage collector does not track it (``gc=False``).

    For the metrics (``time.monotonic()`` seconds): ``scheduled_time``, when the engine first
    scheduled the request (``Request.scheduled_time``), comes with each of its outputs;
    ``timestamp``, when the engine step that made the output ended, is sent once per step
    (``EngineCoreOutputs.timestamp``) and set here by the front end's client."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    new_prompt_logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_cached_images: int = 0  # see Request.num_cached_images
    scheduled_time: float | None = None
    timestamp: float | None = None
    pooling_output: list[float] | None = None  # a pooling request's embedding, as it finishes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
