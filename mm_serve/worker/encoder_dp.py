"""Encoder data parallelism under tensor parallelism (vLLM's ``mm_encoder_tp_mode="data"``).

Every TP rank holds the whole vision tower (``config.parallel.check_tensor_parallel``). In
"weights" mode each rank encodes every image of a step. In "data" mode the step's images are
split across the ranks by their patch counts (``assign_images``, the same split on every
rank), each rank encodes its share, and the rows are gathered to every rank
(``parallel_state.tp_all_gather_rows``): each rank then holds what one tower call over all the
images gives, in image order, and the model runner puts each image's rows in the encoder cache
under its mm_hash as before.

The split wraps the model's ``tower_runner`` (``(pixel_values, grids) -> rows``: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, whose DeepStack features are further columns of the same rows and so
are gathered with them). What the model does around the tower call (moving the pixels to the
device; Qwen3-VL's text rows of a video, embedded through the vocab-parallel embedding, an
all-reduce) still runs on every rank over every image, so the ranks' collectives stay in step.
Models without a ``tower_runner`` keep "weights".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from mm_serve.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather_rows

logger = logging.getLogger(__name__)

# ``(pixel_values [sum of patches, C * T * P * P], grids [[t, h, w], ...]) -> [sum of rows, width]``
Tower = Callable[[torch.Tensor, list[list[int]]], torch.Tensor]


def assign_images(costs: Sequence[int], num_ranks: int) -> list[list[int]]:
    """The image indices each rank encodes, ascending: images largest-first, each onto the
    least-loaded rank (the lowest rank on a tie; equal costs in index order), so every rank
    computes the same split from the same ``costs`` (e.g. patches per image)."""
    loads = [0] * num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += costs[index]
    return [sorted(share) for share in shares]


class DataParallelTower:
    """A ``Tower`` that encodes this TP rank's share of the images with ``tower`` and gathers
    every rank's rows: the same ``[sum of rows, width]`` (image ``i`` gives ``t * h * w //
    merge**2`` rows) as ``tower`` over all the images, on every rank.

    ``width`` and the pixels' dtype give the empty output of a rank without images (a step
    with fewer images than ranks); every rank must call it with the same grids.
    """

    def __init__(self, tower: Tower, spatial_merge_size: int, width: int) -> None:
        self.tower = tower
        self.merge = spatial_merge_size
        self.width = width

    def __call__(self, pixel_values: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        patches = [int(t) * int(h) * int(w) for t, h, w in grids]
        shares = assign_images(patches, get_tp_size())
        local = self._encode(pixel_values, grids, patches, shares[get_tp_rank()])
        rows = [n // self.merge**2 for n in patches]
        counts = [sum(rows[i] for i in share) for share in shares]
        gathered = tp_all_gather_rows(local, counts)
        per_image: list[torch.Tensor | None] = [None] * len(grids)
        for share, part in zip(shares, gathered, strict=True):
            for index, piece in zip(share, part.split([rows[i] for i in share]), strict=True):
                per_image[index] = piece
        return torch.cat(per_image)

    def _encode(
        self,
        pixel_values: torch.Tensor,  # [sum of patches, C * T * P * P]
        grids: list[list[int]],
        patches: list[int],
        share: list[int],
    ) -> torch.Tensor:
        """``tower`` over the images ``share`` -> ``[their rows, width]`` (none: empty)."""
        if not share:
            return pixel_values.new_empty(0, self.width)
        starts = [0]
        for n in patches:
            starts.append(starts[-1] + n)
        mine = torch.cat([pixel_values[starts[i] : starts[i + 1]] for i in share])
        return self.tower(mine, [list(grids[i]) for i in share])


def shard_tower_over_ranks(model: torch.nn.Module, mode: str) -> bool:
    """With ``mode`` "data" and more than one TP rank, make ``model``'s ``tower_runner`` a
    ``DataParallelTower`` around it (the tower's CUDA graphs, when captured, else the eager
    tower); returns whether it did. Call it after ``capture_tower_graphs``, which sets the
    ``tower_runner`` it wraps. A model without a ``tower_runner`` keeps encoding every image
    on every rank (logged)."""
    if mode != "data" or get_tp_size() == 1 or not hasattr(model, "embed_images"):
        return False  # a text model has no tower
    if not hasattr(model, "tower_runner"):
        logger.info(
            "%s encodes every image on every TP rank: mm_encoder_tp_mode='data' splits the "
            "Qwen-VL towers only.",
            type(model).__name__,
        )
        return False
    tower = model.tower_runner or _eager_tower(model.visual)
    width = getattr(model, "inputs_embeds_size", None) or model.config.text_config.hidden_size
    model.tower_runner = DataParallelTower(tower, model.spatial_merge_size, width)
    logger.info("Each step's images are split over the %d TP ranks' towers.", get_tp_size())
    return True


def _eager_tower(visual: torch.nn.Module) -> Tower:
    """``visual``'s forward as a ``Tower`` (its grids as the ``[N, 3]`` tensor it takes)."""
    return lambda pixel_values, grids: visual(pixel_values, torch.tensor(grids, dtype=torch.long))
