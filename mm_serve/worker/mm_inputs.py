"""Multimodal inputs of one step: image embeddings for the scheduled windows, mrope positions.

A request's step covers prompt positions ``[num_computed, num_computed + num_scheduled)``. An
image whose placeholder range overlaps that window must have its embeddings (run through the
vision encoder once, then kept by mm_hash); the overlapping slice replaces the placeholder
tokens' embeddings. A chunk may cut an image in two: the next chunk takes the rest of the same
cached embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mm_serve.worker.input_batch import CachedRequestState


@dataclass
class EmbeddingSlice:
    """Rows ``[start, end)`` of image ``mm_hash``'s embeddings go to batch rows from ``dst``."""

    dst: int
    mm_hash: str
    start: int
    end: int


class EncoderOutputs:
    """mm_hash → ``[num_tokens, hidden]`` embeddings, kept while a live request still has
    tokens of that image's placeholder range to compute.

    (The scheduler-driven encoder cache with budgets replaces this bookkeeping later.)
    """

    def __init__(self) -> None:
        self.embeddings: dict[str, torch.Tensor] = {}

    def free_consumed(
        self, states: dict[str, CachedRequestState], num_scheduled: dict[str, int]
    ) -> None:
        """Drop images every live request has computed past (after this step's tokens).

        A request preempted later recomputes from scratch and re-encodes its images.
        """
        if not self.embeddings:
            return
        needed = {
            f.mm_hash
            for req_id, state in states.items()
            for f in state.mm_features
            if state.num_computed_tokens + num_scheduled.get(req_id, 0) < f.placeholder.end
        }
        for mm_hash in list(self.embeddings):
            if mm_hash not in needed:
                del self.embeddings[mm_hash]


def scheduled_slices(
    states: list[CachedRequestState], num_computed: np.ndarray, query_start_loc: np.ndarray
) -> list[tuple[EmbeddingSlice, object]]:
    """The image slices inside this step's windows, with each image's preprocessed data."""
    slices = []
    for row, state in enumerate(states):
        start = int(num_computed[row])
        end = start + int(query_start_loc[row + 1] - query_start_loc[row])
        for feature in state.mm_features:
            placeholder = feature.placeholder
            lo, hi = max(start, placeholder.offset), min(end, placeholder.end)
            if lo < hi:
                dst = int(query_start_loc[row]) + lo - start
                piece = EmbeddingSlice(
                    dst, feature.mm_hash, lo - placeholder.offset, hi - placeholder.offset
                )
                slices.append((piece, feature.data))
    return slices


def gather_image_embeddings(
    model: torch.nn.Module,
    encoder_outputs: EncoderOutputs,
    slices: list[tuple[EmbeddingSlice, object]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode the images not yet encoded (one batched call), then gather the slices.

    Returns ``(batch row indices [n] int64, embeddings [n, hidden])``.
    """
    missing = {}
    for piece, data in slices:
        if piece.mm_hash not in encoder_outputs.embeddings:
            missing.setdefault(piece.mm_hash, data)
    if missing:
        embeds = model.embed_images(list(missing.values()))
        encoder_outputs.embeddings.update(zip(missing, embeds, strict=True))
    rows = torch.cat([torch.arange(p.dst, p.dst + p.end - p.start) for p, _ in slices])
    values = torch.cat([encoder_outputs.embeddings[p.mm_hash][p.start : p.end] for p, _ in slices])
    return rows.to(device), values


def mrope_positions(
    states: list[CachedRequestState], positions: np.ndarray, query_start_loc: np.ndarray
) -> np.ndarray:
    """``[3, num_tokens]`` (t, h, w) positions: the precomputed prompt table inside the prompt,
    ``position + mrope_delta`` on all three axes after it (Qwen2-VL's M-RoPE)."""
    out = np.empty((3, len(positions)), dtype=np.int64)
    for row, state in enumerate(states):
        lo, hi = int(query_start_loc[row]), int(query_start_loc[row + 1])
        pos = positions[lo:hi]
        table = state.mrope_positions
        in_prompt = pos < table.shape[1]
        out[:, lo:hi][:, in_prompt] = table[:, pos[in_prompt]]
        out[:, lo:hi][:, ~in_prompt] = pos[~in_prompt] + state.mrope_delta
    return out
