"""The contract between the model runner and the sampler for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mm_serve.sched.structured_output import GrammarBitmask


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for the ``num_rows`` requests that produce a token this step.

    Row ``i`` of the logits belongs to the ``i``-th such request. Per-row tensors are on the
    logits' device. Optional tensors are None when no row needs that step, so the common
    greedy / plain-temperature batch pays nothing for the rest.
    """

    temperature: torch.Tensor  # [num_rows] float32; rows with 0 are greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [num_rows] float32, 1.0 = off
    top_k: torch.Tensor | None  # [num_rows] int64, 0 = off
    min_p: torch.Tensor | None  # [num_rows] float32, 0.0 = off
    # Row -> that request's own generator; rows without one use the global generator.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Largest ``logprobs`` asked for by any row; None when no row wants logprobs.
    max_num_logprobs: int | None = None
    no_penalties: bool = True
    presence_penalties: torch.Tensor | None = None  # [num_rows] float32
    frequency_penalties: torch.Tensor | None = None  # [num_rows] float32
    repetition_penalties: torch.Tensor | None = None  # [num_rows] float32
    # Prompt tokens, padded with ``vocab_size`` (an id no logit has); only with penalties.
    prompt_token_ids: torch.Tensor | None = None  # [num_rows, max_prompt_len] int64
    # Per row, the tokens generated so far; only with penalties.
    output_token_ids: list[list[int]] = field(default_factory=list)
    # Row -> token ids to forbid this step (stop tokens and EOS while below min_tokens).
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Row -> {token id: bias added to its logit} (``SamplingParams.logit_bias``).
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    # The rows with a grammar and the tokens each may sample (``structured_outputs``).
    grammar: GrammarMask | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of its raw logits: greedy, with no logprobs, penalties,
        bias, banned tokens or grammar."""
        return (
            self.all_greedy
            and self.max_num_logprobs is None
            and self.no_penalties
            and not self.banned_token_ids
            and not self.logit_bias
            and self.grammar is None
        )


@dataclass
class GrammarMask:
    """The grammar requests' rows of the logits, and the tokens each may sample."""

    rows: torch.Tensor  # [k] int64, rows of the logits
    bitmask: torch.Tensor  # [k, words] int32, xgrammar's layout (``GrammarBitmask``)
    num_tokens: int  # tokens the bitmask covers; every later one is forbidden

    @classmethod
    def for_rows(
        cls, grammar_bitmask: GrammarBitmask, row_req_ids: list[str], device: torch.device
    ) -> GrammarMask | None:
        """The mask of the step whose logits row ``i`` belongs to ``row_req_ids[i]``; requests
        of ``grammar_bitmask`` not among them (finished meanwhile) are left out."""
        row_of = {req_id: row for row, req_id in enumerate(row_req_ids)}
        pairs = [(row_of[r], i) for i, r in enumerate(grammar_bitmask.req_ids) if r in row_of]
        if not pairs:
            return None
        rows, kept = zip(*pairs, strict=True)
        bitmask = grammar_bitmask.bitmask.to(device, non_blocking=True)
        if len(kept) < len(bitmask):
            bitmask = bitmask[torch.tensor(kept).to(device, non_blocking=True)]
        rows = torch.tensor(rows).to(device, non_blocking=True)
        return cls(rows, bitmask, grammar_bitmask.num_tokens)


@dataclass
class LogprobsTensors:
    """Top-k log-probabilities per row; column 0 is the sampled (or given) token."""

    token_ids: torch.Tensor  # [num_rows, 1 + k] int64
    logprobs: torch.Tensor  # [num_rows, 1 + k] float32
    ranks: torch.Tensor  # [num_rows] int64, rank of column 0's token (1 = most likely)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprobs: LogprobsTensors | None  # None when max_num_logprobs is None
