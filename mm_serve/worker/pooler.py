"""The pooling runner's pooler: a prompt's final hidden states (after the LM's final norm,
before the LM head) into its embedding.

A pooling request runs its prompt through the same steps as any prefill, chunked or not, and
samples nothing. "LAST" takes the hidden state of the prompt's last token, which the step
that computes it holds. "MEAN" averages over every prompt token, so each step adds its chunk's
hidden states into the request's running sum (``CachedRequestState.hidden_states_sum``, reset
when a preempted request starts over); a chunked prompt therefore pools what one whole step
would. Every prompt token must be computed by this request: the pooling runner has no prefix
caching (``EngineArgs.create_engine_config``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mm_serve.worker.input_batch import CachedRequestState


@dataclass
class PoolingStep:
    """The pooling requests of one step: the batch's rows in order (every row is one under
    the pooling runner), where each row's tokens start in the flattened batch, and the rows
    whose prompt ends this step."""

    states: list[CachedRequestState]
    query_start_loc: Sequence[int]  # [num_reqs + 1]
    finished_rows: np.ndarray  # [k] int64


def pool(hidden_states: torch.Tensor, step: PoolingStep) -> dict[str, torch.Tensor]:
    """The embedding of each request whose prompt ends this step, by request id: ``[d]``
    float32 (``d``: ``dimensions``, else the hidden size), L2-normalised if asked.

    ``hidden_states``: ``[num_tokens, hidden]``, the step's final hidden states (a CUDA graph's
    padding rows past ``query_start_loc[-1]`` are never read).
    """
    starts = [int(start) for start in step.query_start_loc]
    for row, state in enumerate(step.states):
        if state.pooling_params.pooling_type == "MEAN":
            chunk_sum = hidden_states[starts[row] : starts[row + 1]].float().sum(dim=0)
            previous = state.hidden_states_sum
            state.hidden_states_sum = chunk_sum if previous is None else previous + chunk_sum
    embeddings = {}
    for row in step.finished_rows.tolist():
        state = step.states[row]
        if state.pooling_params.pooling_type == "MEAN":
            pooled = state.hidden_states_sum / len(state.prompt_token_ids)
        else:  # LAST; a copy: a CUDA graph's output buffer is rewritten by the next replay
            pooled = hidden_states[starts[row + 1] - 1].to(torch.float32, copy=True)
        embeddings[state.req_id] = finish_embedding(pooled, state)
    return embeddings


def finish_embedding(pooled: torch.Tensor, state: CachedRequestState) -> torch.Tensor:
    """``pooled`` ``[hidden]`` cut to the request's ``dimensions`` (Matryoshka), then
    L2-normalised when its ``normalize`` says so (vLLM's order)."""
    params = state.pooling_params
    if params.dimensions is not None:
        pooled = pooled[: params.dimensions]
    if params.normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
    return pooled
