"""Vocab-parallel token embedding and LM head: each rank holds ``ceil(vocab / tp)`` rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mm_serve.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tp_all_gather,
    tp_all_reduce,
)


class VocabParallelEmbedding(nn.Module):
    """Token id -> embedding, ``[num_tokens] -> [num_tokens, embedding_dim]``.

    Rank ``r`` owns ids ``[r * shard, (r + 1) * shard)``; other ids give zeros there, and the
    all-reduce sums the one non-zero row. The last shard is zero-padded past the vocabulary.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_size = get_tp_size()
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = get_tp_rank() * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded_weight.shape != (self.num_embeddings, param.shape[1]):
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                f"expected {(self.num_embeddings, param.shape[1])}"
            )
        part = loaded_weight[self.vocab_start : self.vocab_end]
        param.data[: part.shape[0]].copy_(part)
        param.data[part.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = F.embedding((input_ids - self.vocab_start) * mask, self.weight)
        return tp_all_reduce(local * mask.unsqueeze(-1).to(local.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary, ``[N, hidden] -> [N, vocab]``.

    Each rank computes its vocab shard's logits; they are gathered in rank order and the
    padding columns of the last shard dropped.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        return tp_all_gather(logits, dim=-1)[..., : self.num_embeddings]
