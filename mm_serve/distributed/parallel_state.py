"""Tensor-parallel state: this worker's rank and the group size (1 by default).

Model layers read the rank and size when they are built, to size and slice their shards, and
call the collectives below in ``forward``; with a size of 1 the collectives are no-ops, so
single-GPU and CPU runs never touch ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelState:
    rank: int = 0
    size: int = 1


_TP = TensorParallelState()


def init_tensor_parallel(rank: int, size: int) -> None:
    """Set this process's TP rank and size (call once per worker, before building the model).

    With ``size > 1`` the default ``torch.distributed`` process group must already exist.
    """
    global _TP
    if not 0 <= rank < size:
        raise ValueError(f"TP rank {rank} out of range for size {size}.")
    _TP = TensorParallelState(rank, size)


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group (in place); identity with one rank."""
    if _TP.size > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); identity with one rank."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def tp_all_gather_rows(x: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Every rank's rows, in rank order: ``x`` is this rank's ``[counts[rank], width]``, the
    result rank ``r``'s ``[counts[r], width]`` (``counts`` the same on every rank, ``dtype``
    and ``width`` too). The collective needs equal sizes, so each rank sends ``x`` padded to
    ``max(counts)`` rows and the padding is cut off; ``[x]`` with one rank.

    Raises:
        ValueError: ``x`` has a row count other than ``counts[rank]``.
    """
    if x.shape[0] != counts[_TP.rank]:
        raise ValueError(f"{x.shape[0]} rows on TP rank {_TP.rank}, {counts[_TP.rank]} expected.")
    if _TP.size == 1:
        return [x]
    padded = x.new_zeros(max(counts), *x.shape[1:])
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(_TP.size)]
    dist.all_gather(parts, padded)
    return [part[:count] for part, count in zip(parts, counts, strict=True)]
