"""Multimodal inputs of one step: image embeddings for the scheduled windows, mrope positions,
and the key limits of image tokens that attend to each other.

A request's step covers prompt positions ``[num_computed, num_computed + num_scheduled)``. The
scheduler has made sure every image overlapping that window is in the encoder cache (``mm_hash
-> [num_tokens, hidden]``) or is encoded this step (``scheduled_encoder_inputs``); the
overlapping slice replaces the placeholder tokens' embeddings. A chunk may cut an image in two:
the next chunk takes the rest of the same cached embeddings.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mm_serve.messages.request import MultiModalFeature
from mm_serve.models.interface import VisionLanguageModel
from mm_serve.utils.transfer import StepUpload
from mm_serve.worker.input_batch import CachedRequestState

if TYPE_CHECKING:
    from mm_serve.lora.manager import LoRAManager


@dataclass
class EmbeddingSlice:
    """Rows ``[start, end)`` of image ``mm_hash``'s embeddings go to batch rows from ``dst``."""

    dst: int
    mm_hash: str
    start: int
    end: int


def encode_images(
    model: VisionLanguageModel,
    requests: dict[str, CachedRequestState],
    scheduled_encoder_inputs: dict[str, list[int]],
    encoder_cache: dict[str, torch.Tensor],
    lora: LoRAManager | None = None,
) -> None:
    """Run the vision encoder over the images scheduled this step (one batched call per tower
    adapter: ``lora``'s slot of the request's adapter when it targets the tower, else one
    call) and put each ``[num_tokens, hidden]`` result in ``encoder_cache`` under its mm_hash
    (an adapter on the tower is in the mm_hash: ``lora.registry``)."""
    groups: dict[int, dict[str, Any]] = {}  # tower slot -> {mm_hash: item}
    for req_id, input_ids in scheduled_encoder_inputs.items():
        state = requests[req_id]
        slot = -1 if lora is None else lora.tower_slot_of(state.lora_request)
        items = groups.setdefault(slot, {})
        for input_id in input_ids:
            items.setdefault(state.mm_features[input_id].mm_hash, state.mm_features[input_id].data)
    for slot, items in groups.items():
        with nullcontext() if lora is None else lora.context.tower(slot):
            embeddings = model.embed_images(list(items.values()))
        encoder_cache.update(zip(items, embeddings, strict=True))


def scheduled_slices(
    states: list[CachedRequestState],
    prompt_rows: np.ndarray,
    num_computed: np.ndarray,
    query_start_loc: np.ndarray,
) -> list[EmbeddingSlice]:
    """The image slices inside this step's windows; only ``prompt_rows``, the rows whose
    window starts inside their prompt, can have one (images lie inside the prompt)."""
    slices = []
    for row in prompt_rows.tolist():
        state = states[row]
        if not state.mm_features:
            continue
        start = int(num_computed[row])
        end = start + int(query_start_loc[row + 1] - query_start_loc[row])
        for feature in state.mm_features:
            offset = feature.placeholder.offset
            lo, hi = max(start, offset), min(end, feature.placeholder.end)
            if lo < hi:
                dst = int(query_start_loc[row]) + lo - start
                slices.append(EmbeddingSlice(dst, feature.mm_hash, lo - offset, hi - offset))
    return slices


def gather_image_embeddings(
    encoder_cache: dict[str, torch.Tensor], slices: list[EmbeddingSlice], upload: StepUpload
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch row indices [n] int64, embeddings [n, hidden])`` of this step's slices, the
    indices staged in ``upload``.

    Raises:
        RuntimeError: an image's embeddings are neither cached nor encoded this step (a
            scheduler bug, never a user error).
    """
    missing = {piece.mm_hash for piece in slices} - encoder_cache.keys()
    if missing:
        raise RuntimeError(f"No encoder output for images {sorted(missing)} in this step.")
    rows = np.concatenate([np.arange(p.dst, p.dst + p.end - p.start) for p in slices])
    values = torch.cat([encoder_cache[p.mm_hash][p.start : p.end] for p in slices])
    return upload.stage(rows, torch.int64), values


def image_token_runs(feature: MultiModalFeature, image_token_id: int) -> list[tuple[int, int]]:
    """Absolute ``[start, end)`` of each run of consecutive image tokens in the feature's
    placeholder range (its ``token_ids``; all of it when it has none): the tokens of a run
    attend to each other (HF's ``get_block_sequence_ids_for_mask``: one block per run)."""
    offset, token_ids = feature.placeholder.offset, feature.data.token_ids
    if token_ids is None:
        return [(offset, feature.placeholder.end)]
    is_image = np.concatenate([[0], np.asarray(token_ids) == image_token_id, [0]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(is_image)) + offset
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def image_key_end(
    states: list[CachedRequestState],
    positions: np.ndarray,  # [num_tokens] absolute positions
    query_start_loc: np.ndarray,
    num_computed: np.ndarray,
    image_token_id: int,
) -> np.ndarray | None:
    """``AttentionMetadata.key_end`` ``[num_tokens]`` int32: ``position + 1`` (causal), and for
    the image tokens in this step's windows the end of their run (``image_token_runs``); None
    when no window holds an image token.

    Raises:
        RuntimeError: a run that ends past its window (the scheduler must not cut one).
    """
    key_end = None
    for row, state in enumerate(states):
        lo = int(query_start_loc[row])
        start = int(num_computed[row])
        end = start + int(query_start_loc[row + 1]) - lo
        for feature in state.mm_features:
            placeholder = feature.placeholder
            if placeholder.offset >= end or placeholder.end <= start:
                continue
            for run_start, run_end in image_token_runs(feature, image_token_id):
                first, last = max(run_start, start), min(run_end, end)
                if first >= last:
                    continue
                if run_end > end:
                    raise RuntimeError(f"A chunk of {state.req_id} cuts an image at {end}.")
                if key_end is None:
                    key_end = (positions + 1).astype(np.int32)
                key_end[lo + first - start : lo + last - start] = run_end
    return key_end


def mrope_positions(
    states: list[CachedRequestState],
    mrope_delta: np.ndarray,
    positions: np.ndarray,
    query_start_loc: np.ndarray,
    prompt_rows: np.ndarray,
) -> np.ndarray:
    """``[3, num_tokens]`` (t, h, w) positions: the precomputed prompt table inside the prompt,
    ``position + mrope_delta`` (``[num_reqs]``) on all three axes after it (Qwen2-VL's M-RoPE).

    Vectorised over the batch; only ``prompt_rows``, whose window starts inside the prompt
    (prefill chunks), are looked up in their table one by one.
    """
    num_scheduled = np.diff(query_start_loc)
    out = np.repeat((positions + np.repeat(mrope_delta, num_scheduled))[None], 3, axis=0)
    for row in prompt_rows.tolist():
        table = states[row].mrope_positions
        lo, hi = int(query_start_loc[row]), int(query_start_loc[row + 1])
        pos = positions[lo:hi]
        in_prompt = pos < table.shape[1]
        out[:, lo:hi][:, in_prompt] = table[:, pos[in_prompt]]
    return out
