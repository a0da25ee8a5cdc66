"""Prompt logprobs: how likely the model found each prompt token given the tokens before it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_serve.worker.sampler import compute_topk_logprobs


@dataclass
class PromptLogprobsJob:
    """One request's prompt positions in this step's flattened batch."""

    req_id: str
    num_logprobs: int  # top-k to report beside the actual token
    token_indices: torch.Tensor  # [n] rows of the batch whose hidden state predicts the next
    next_token_ids: torch.Tensor  # [n] the prompt tokens those rows predict


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
