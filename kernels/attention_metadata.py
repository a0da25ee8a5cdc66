"""The contract between the model runner and the attention layers of one forward pass."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mm_serve.kernels.varlen_attention import PrefillSplit


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flattened batch and in the paged KV cache.

    The batch is ``num_reqs`` requests, their scheduled tokens concatenated (varlen, no padding):
    request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, whose absolute
    positions are ``seq_lens[i] - query_len_i ... seq_lens[i] - 1`` (a prefill chunk or one
    decode token). Attention is causal over the request's ``seq_lens[i]`` tokens, whose K/V live
    in the blocks ``block_table[i, :ceil(seq_lens[i] / block_size)]``.

    The KV cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then
    V); token ``t`` of the batch is written to flat slot ``slot_mapping[t]`` =
    ``block_id * block_size + offset``.

    ``prefill_split`` (set by the model runner on CUDA for steps with a fresh prefill) sends
    those prefills through FlashAttention-2's varlen kernel, the others through the paged one.

    ``key_end`` (None: causal) gives each query row one past the absolute position of the last
    key it sees: ``position + 1`` for causal rows, the end of its image for the tokens of an
    image that attend to each other bidirectionally (Gemma 3, as HF's token-type mask). It never
    exceeds the request's ``seq_lens[i]``: the scheduler never cuts such an image.

    A model whose layers use several KV-cache groups (``cache.kv_cache_groups``: sliding-window
    and full-attention layers) has one block table and slot mapping per group: this object is
    group 0's, and ``group_metadata[g - 1]`` group ``g``'s, alike in everything else
    (``for_group``).
    """

    num_reqs: int
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copies, for the pure-torch reference's loop
    seq_lens_cpu: list[int]
    prefill_split: PrefillSplit | None = None
    key_end: torch.Tensor | None = None  # [num_tokens] int32
    group_metadata: tuple[AttentionMetadata, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV-cache group ``group`` (0: this one)."""
        return self if group == 0 else self.group_metadata[group - 1]


def paged_metadata(
    reqs: list[tuple[int, int]], tables: list[list[int]], block_size: int, device
) -> AttentionMetadata:
    """The metadata of one step of ``reqs`` = ``[(cached tokens, new tokens)]``, one block table
    each in ``tables`` (padded with block 0 to the longest): token ``p`` of a request goes to
    slot ``table[p // block_size] * block_size + p % block_size``. For kernel tests and
    benchmarks, where a hand-made batch stands in for the model runner's."""
    starts = [0, *itertools.accumulate(n for _, n in reqs)]
    seq_lens = [c + n for c, n in reqs]
    slots = [t[p // block_size] * block_size + p % block_size
             for (c, n), t in zip(reqs, tables, strict=True) for p in range(c, c + n)]  # fmt: skip
    width = max(map(len, tables))
    as_tensor = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return AttentionMetadata(
        num_reqs=len(reqs),
        num_tokens=starts[-1],
        slot_mapping=as_tensor(slots, torch.int64),
        query_start_loc=as_tensor(starts, torch.int32),
        seq_lens=as_tensor(seq_lens, torch.int32),
        block_table=as_tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
        max_query_len=max(n for _, n in reqs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
