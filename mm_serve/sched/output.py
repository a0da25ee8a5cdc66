"""What the scheduler tells the model runner each step, and what comes back.

A new request is sent whole once (``NewRequestData``); after that only diffs
(``CachedRequestData``), so every worker can replay the same state from the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mm_serve.lora.request import LoRARequest
from mm_serve.messages.pooling_params import PoolingParams
from mm_serve.messages.request import MultiModalFeature, Request
from mm_serve.messages.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: everything it needs, once."""

    req_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            mm_features=request.mm_features,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
        )


@dataclass
class CachedRequestData:
    """Diffs for requests the runner already holds, one entry per request (parallel lists).

    ``resumed_from_preemption[i]`` means the request lost its blocks: ``new_block_ids[i]``
    replaces its block list instead of extending it. ``num_computed_tokens[i]``: its computed
    tokens before the step.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @classmethod
    def from_rows(cls, rows: list[CachedRow]) -> CachedRequestData:
        """The columns of ``(req_id, resumed, new_block_ids, num_computed_tokens)`` rows."""
        if not rows:
            return cls()
        req_ids, resumed, new_block_ids, num_computed = map(list, zip(*rows, strict=True))
        return cls(req_ids, resumed, new_block_ids, num_computed)


# One request's ``CachedRequestData`` entry: (req_id, resumed, new_block_ids, num_computed).
CachedRow = tuple[str, bool, list[int], int]


@dataclass
class StepDecisions:
    """What one ``Scheduler.schedule()`` call has decided so far, and the budgets left."""

    token_budget: int
    encoder_budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_rows: list[CachedRow] = field(default_factory=list)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    structured_output_request_ids: list[str] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's decisions: ``{request_id: num_tokens}`` plus the diffs the runner applies."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Request ids that finished or were aborted since the last step: the runner drops them.
    finished_req_ids: set[str]
    # request id -> indices into its mm_features to run through the vision encoder this step.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # mm_hashes whose encoder outputs the runner may free.
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # Requests with a grammar that sample a token this step (``Scheduler.grammar_bitmask``).
    structured_output_request_ids: list[str] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """What one step produced, per request of the batch (parallel to ``req_ids``).

    ``sampled_token_ids[i]`` is empty for a request still in the middle of its prompt.
    ``logprobs[i]`` is ``(token_ids, logprobs, rank)`` of the sampled token and the top-k, as
    python lists, or None. ``prompt_logprobs`` maps a request id to this step's chunk of prompt
    logprobs, one ``(token_ids, logprobs, rank)`` per prompt position predicted.
    ``pooler_output`` maps a pooling request whose prompt ended this step to its embedding.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[tuple[list[int], list[float], int] | None]
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]]
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
