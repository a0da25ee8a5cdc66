"""Turns one step's logits into sampled token ids, and their logprobs when asked for.

Pipeline, in vLLM's order (documented on ``SamplingParams``):

    raw logprobs (reported) -> repetition / frequency / presence penalties -> logit bias
    -> grammar bitmask (structured outputs) -> banned tokens -> greedy rows: argmax
    -> random rows: temperature -> min-p -> top-k -> top-p -> exponential-race sample

Every tensor stays on the logits' device. The only host round trip is in mixed greedy/random
batches that carry per-request generators (see ``Sampler._sample``).
"""

from __future__ import annotations

import torch
from torch import nn

from mm_serve.worker.sampling_metadata import LogprobsTensors, SamplerOutput, SamplingMetadata

# Temperatures below this are greedy; the same threshold as ``SamplingParams.greedy``.
_GREEDY_EPS = 1e-5
_NEG_INF = float("-inf")


class Sampler(nn.Module):
    """Samples one token per row of ``logits`` following each row's ``SamplingMetadata``."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample the next token of every row.

        Args:
            logits: ``[num_rows, vocab_size]``, the model's raw next-token logits in its dtype;
                upcast to float32 unless the step is plain greedy. Not modified.
            metadata: per-row settings; row ``i`` of every tensor belongs to row ``i`` here.

        Returns:
            ``SamplerOutput`` with ``sampled_token_ids`` ``[num_rows]`` int64 and, when
            ``metadata.max_num_logprobs`` is not None, the raw-model logprobs of the sampled
            token plus the top ``max_num_logprobs`` tokens of every row.
        """
        if metadata.plain_greedy:  # the argmax of exact float32 upcasts: no upcast needed
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1), logprobs=None)
        logits = logits.float()
        # Reported logprobs are those of the model itself, before any processing (OpenAI/vLLM).
        num_logprobs = metadata.max_num_logprobs
        raw_logprobs = None if num_logprobs is None else torch.log_softmax(logits, dim=-1)

        logits = apply_penalties(logits, metadata)
        logits = apply_logit_bias(logits, metadata.logit_bias)
        if (grammar := metadata.grammar) is not None:
            logits = apply_token_bitmask(logits, grammar.rows, grammar.bitmask, grammar.num_tokens)
        # After the bitmask: a grammar that allows only stop tokens (its output is complete)
        # wins over min_tokens, whose ban would leave the row nothing to sample.
        logits = apply_banned_tokens(logits, metadata.banned_token_ids, grammar is not None)
        sampled = self._sample(logits, metadata)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = compute_topk_logprobs(raw_logprobs, num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; random rows are truncated and sampled. ``[num_rows]``."""
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy

        is_greedy = metadata.temperature < _GREEDY_EPS
        # Greedy rows get temperature 1 only to avoid dividing by 0; their draw is discarded.
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        logits = logits / temperature[:, None]
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)

        skip_rows: set[int] = set()
        if metadata.generators and not metadata.all_random:
            # A greedy row must not advance its generator, so we need to know on the host
            # which seeded rows are greedy: one small sync, only for mixed seeded batches.
            row_is_greedy = is_greedy.tolist()
            skip_rows = {row for row in metadata.generators if row_is_greedy[row]}
        sampled = exponential_race(logits.softmax(dim=-1), metadata.generators, skip_rows)
        return sampled if greedy is None else torch.where(is_greedy, greedy, sampled)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties; returns a new ``[num_rows, vocab]``.

    - Repetition (Keskar et al. 2019, CTRL, as in HF / vLLM): every token seen in the prompt or
      the output so far has its logit divided by ``r`` when positive, multiplied when negative.
    - Frequency (OpenAI API): ``logit -= f * count_in_output``.
    - Presence (OpenAI API): ``logit -= p * (count_in_output > 0)``.

    A penalty tensor left as None is skipped; ``metadata.no_penalties`` skips all of them.
    """
    if metadata.no_penalties:
        return logits
    num_rows, vocab_size = logits.shape
    output_ids = _pad_token_ids(metadata.output_token_ids, vocab_size, logits.device)
    output_counts = _token_counts(output_ids, vocab_size, logits.dtype)  # [num_rows, vocab]
    in_output = output_counts > 0

    if metadata.repetition_penalties is not None:
        seen = in_output
        if metadata.prompt_token_ids is not None:
            seen = seen | (_token_counts(metadata.prompt_token_ids, vocab_size, logits.dtype) > 0)
        penalty = torch.where(seen, metadata.repetition_penalties[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if metadata.frequency_penalties is not None:
        logits = logits - metadata.frequency_penalties[:, None] * output_counts
    if metadata.presence_penalties is not None:
        logits = logits - metadata.presence_penalties[:, None] * in_output
    return logits


def _pad_token_ids(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Per-row id lists -> ``[num_rows, max_len]`` int64, padded with ``vocab_size``."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = [ids + [vocab_size] * (max_len - len(ids)) for ids in token_ids]
    return torch.tensor(padded, dtype=torch.int64, device=device).view(len(token_ids), max_len)


def _token_counts(token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[num_rows, len]`` ids padded with ``vocab_size`` -> ``[num_rows, vocab_size]`` counts."""
    counts = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=dtype, device=token_ids.device
    )  # the extra column absorbs the padding id
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=dtype))
    return counts[:, :vocab_size]


def apply_banned_tokens(
    logits: torch.Tensor, banned: dict[int, list[int]], keep_samplable: bool = False
) -> torch.Tensor:
    """Set ``logits[row, token]`` to -inf for every banned ``(row, token)``; returns a copy.
    With ``keep_samplable``, a row the ban would leave all -inf keeps its logits (the tokens
    a grammar allows are all banned: the grammar wins)."""
    if not banned:
        return logits
    rows = [row for row, ids in banned.items() for _ in ids]
    cols = [token for ids in banned.values() for token in ids]
    index = torch.tensor([rows, cols], dtype=torch.int64, device=logits.device)
    neg_inf = torch.tensor(_NEG_INF, dtype=logits.dtype, device=logits.device)
    masked = logits.index_put((index[0], index[1]), neg_inf)
    if not keep_samplable:
        return masked
    samplable = (masked > _NEG_INF).any(dim=-1, keepdim=True)  # [num_rows, 1]
    return torch.where(samplable, masked, logits)


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> torch.Tensor:
    """Add ``logit_bias[row][token]`` to ``logits[row, token]`` (OpenAI's ``logit_bias``);
    returns a copy when there is any bias."""
    if not logit_bias:
        return logits
    rows = [row for row, biases in logit_bias.items() for _ in biases]
    cols = [token for biases in logit_bias.values() for token in biases]
    values = [bias for biases in logit_bias.values() for bias in biases.values()]
    index = torch.tensor([rows, cols], dtype=torch.int64, device=logits.device)
    bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits.index_put((index[0], index[1]), bias, accumulate=True)


def apply_token_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Set to -inf every token a row's grammar forbids, for all grammar rows in one pass.

    Args:
        logits: ``[num_rows, vocab_size]``.
        rows: ``[k]`` int64, the rows with a grammar.
        bitmask: ``[k, words]`` int32; bit ``j`` of word ``w`` of row ``i`` allows token
            ``32 * w + j`` in row ``rows[i]`` (xgrammar's layout).
        num_tokens: the tokens the bitmask covers (the tokenizer's); the bits past it and the
            logits past it (a vocabulary padded beyond the tokenizer's) are forbidden.

    Returns:
        A copy of ``logits`` with the forbidden tokens of those rows at -inf.
    """
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)
    allowed = allowed[:, : min(num_tokens, vocab_size)]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    masked = logits[rows].masked_fill(~allowed, _NEG_INF)
    return logits.index_put((rows,), masked)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p truncation (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling").

    Drops every token whose probability is below ``min_p * max_prob`` of its row.

    Args:
        logits: ``[num_rows, vocab]``, already divided by the temperature.
        min_p: ``[num_rows]`` float32; 0 keeps every token.
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k, then top-p (nucleus, Holtzman et al. 2019), with one descending sort per row.

    Top-k keeps the ``k`` highest logits (ties at the boundary broken by the sort). Top-p then
    renormalises what is left and keeps the smallest prefix whose probability mass reaches
    ``top_p``: a token survives when the mass strictly above it is still ``< top_p``, so the
    top token always survives.

    Args:
        logits: ``[num_rows, vocab]``, temperature-scaled (and possibly min-p masked).
        top_k: ``[num_rows]`` int64, 0 = off; or None.
        top_p: ``[num_rows]`` float32 in (0, 1], 1 = off; or None.

    Returns:
        ``[num_rows, vocab]`` with the dropped tokens set to -inf.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
        positions = torch.arange(vocab_size, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(positions >= k[:, None], _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        # top_p == 1 is off: rounding in the cumsum must not drop the far tail.
        drop = (mass_above >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    # ``order`` is a permutation, so the scatter overwrites every entry.
    return logits.scatter(-1, order, sorted_logits)


def exponential_race(
    probs: torch.Tensor, generators: dict[int, torch.Generator], skip_rows: set[int]
) -> torch.Tensor:
    """Draw one token per row from ``probs`` ``[num_rows, vocab]``; returns ``[num_rows]`` int64.

    ``argmax_i probs_i / q_i`` with ``q_i ~ Exp(1)`` i.i.d. is a draw from ``Categorical(probs)``:
    ``q_i / probs_i ~ Exp(rate=probs_i)`` and the smallest of independent exponentials is
    token ``i`` with probability ``probs_i / sum(probs)`` (the "exponential race"; equivalent to
    the Gumbel-max trick). Unlike ``torch.multinomial`` it needs no device-to-host sync.

    Rows in ``generators`` (except ``skip_rows``) redraw their ``q`` row from their own
    generator, exactly one vocab-sized draw per step, so a seeded row's tokens do not depend on
    the rest of the batch. Other rows use the device's default generator.
    """
    q = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        if row not in skip_rows:
            q[row].exponential_(generator=generator)
    # Guard against q == 0: 0 / 0 would be NaN, and argmax picks NaN.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)


def compute_topk_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """Gather the logprob of a given token plus the top ``num_logprobs`` of each row.

    Used for sampled tokens and, by the model runner, for prompt logprobs (``token_ids`` = the
    actual next prompt token).

    Args:
        logprobs: ``[num_rows, vocab]`` float32 log-probabilities.
        num_logprobs: ``k >= 0``; 0 returns only column 0.
        token_ids: ``[num_rows]`` integer, the token to report in column 0.

    Returns:
        ``LogprobsTensors`` with ``[num_rows, 1 + k]`` ids and logprobs (column 0 = the given
        token, then the top-k in descending order) and ``[num_rows]`` ranks, where rank =
        1 + number of tokens with a strictly greater logprob.
    """
    token_ids = token_ids.to(torch.int64)[:, None]  # [num_rows, 1]
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top_ids], dim=1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )
