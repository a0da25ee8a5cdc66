"""Prompt logprobs: how likely the model found each prompt token given the tokens before it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mm_serve.worker.input_batch import InputBatch
from mm_serve.worker.sampler import compute_topk_logprobs


@dataclass
class PromptLogprobsJob:
    """One request's prompt positions in this step's flattened batch."""

    req_id: str
    num_logprobs: int  # top-k to report beside the actual token
    token_indices: torch.Tensor  # [n] rows of the batch whose hidden state predicts the next
    next_token_ids: torch.Tensor  # [n] the prompt tokens those rows predict


def prompt_logprobs_jobs(
    batch: InputBatch,
    prompt_rows: np.ndarray,
    num_computed: np.ndarray,
    query_start_loc: np.ndarray,
    device: torch.device,
) -> list[PromptLogprobsJob]:
    """The step's jobs: each row wanting prompt logprobs whose window covers prompt positions
    not done yet (the hidden state at prompt position p predicts token p+1).

    Args:
        prompt_rows: the batch rows whose window starts inside their prompt (no other row
            has prompt positions left).
        num_computed: ``[num_reqs]`` tokens computed before this step, per batch row.
        query_start_loc: ``[num_reqs + 1]`` start of each row's tokens in the step.
    """
    jobs = []
    for row in prompt_rows.tolist():
        state = batch.states[row]
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        start = max(int(num_computed[row]), state.num_prompt_logprobs_done)
        chunk_end = int(num_computed[row]) + int(query_start_loc[row + 1] - query_start_loc[row])
        end = min(chunk_end, len(state.prompt_token_ids) - 1)
        if start >= end:
            continue
        first = int(query_start_loc[row]) + start - int(num_computed[row])
        jobs.append(
            PromptLogprobsJob(
                req_id=state.req_id,
                num_logprobs=k,
                token_indices=torch.arange(first, first + end - start, device=device),
                next_token_ids=torch.tensor(
                    state.prompt_token_ids[start + 1 : end + 1], device=device
                ),
            )
        )
        state.num_prompt_logprobs_done = end
    return jobs


def compute_prompt_logprobs(
    model: torch.nn.Module, hidden_states: torch.Tensor, jobs: list[PromptLogprobsJob]
) -> dict[str, list[tuple[list[int], list[float], int]]]:
    """Per request: one ``(token_ids, logprobs, rank)`` per predicted prompt position.

    ``hidden_states`` is ``[num_tokens, hidden]``; logprobs are the raw log-softmax of the
    logits, column 0 being the actual prompt token.
    """
    results = {}
    for job in jobs:
        logits = model.compute_logits(hidden_states[job.token_indices])
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = compute_topk_logprobs(logprobs, job.num_logprobs, job.next_token_ids)
        results[job.req_id] = list(
            zip(top.token_ids.tolist(), top.logprobs.tolist(), top.ranks.tolist(), strict=True)
        )
    return results
