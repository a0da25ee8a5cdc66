"""Multimodal RoPE positions (M-RoPE) of a prompt for Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

M-RoPE (arXiv:2409.12191, section 2.1): every token has three positions (temporal, height,
width). Text tokens have all three equal, counting up by one. An image or video (a ``t x (h /
merge) x (w / merge)`` grid) starts at the position ``p`` after the preceding text: token
``(i, j, k)`` gets ``(p + time(i), p + j, p + k)``; the text after resumes at
``p + max(h, w) / merge``. ``time(i) = i`` for images and Qwen2-VL videos; Qwen2.5-VL
(arXiv:2502.13923, section 2.1): ``time(i) = int(i * tokens_per_second * second_per_grid_t)``
in float32. A Qwen3-VL video places each temporal patch as an image of grid ``(1, h, w)``, the
time texts between them counted as text. Equals HF ``get_rope_index`` of ``Qwen2VLModel``,
``Qwen2_5_VLModel`` and ``Qwen3VLModel`` (transformers 5.23).

``mrope_position_delta`` shifts decode positions: the token at sequence index
``i >= len(prompt)`` has position ``i + delta`` on all axes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from mm_serve.encoders.base import ProcessedImage

# An image's grid ``(t, h, w)``, or a ``ProcessedImage`` (an image or a video).
MRopeItem = tuple[int, int, int] | ProcessedImage


def _spans(
    token_ids: list[int], items: Sequence[MRopeItem], hf_config: Any, merge: int
) -> list[tuple[int, int, tuple[int, int, int], float | None]]:
    """``(start, end, grid_thw, time_interval)`` of each item's placeholder run, in prompt
    order (``time_interval`` None: consecutive temporal positions).

    Each item takes ``t * h * w // merge**2`` consecutive tokens of its placeholder token (the
    config's ``image_token_id``, or ``video_token_id`` for a video; two adjacent items are told
    apart by their sizes). Once every item is placed, the rest is text: a prompt that
    continues generated text (beam search) may hold an image or video token id the model
    sampled (the front end checks a user's prompt for as many placeholders as items). Raises
    ``ValueError`` if the runs do not match ``items``.
    """
    image_token = hf_config.image_token_id
    video_token = getattr(hf_config, "video_token_id", None)
    tokens_per_second = getattr(hf_config.vision_config, "tokens_per_second", None)
    parts = [part for item in items for part in _frame_groups(item)]
    spans, pos, item_iter = [], 0, iter(parts)
    while pos < len(token_ids):
        if token_ids[pos] not in (image_token, video_token):
            pos += 1
            continue
        item = next(item_iter, None)
        if item is None:
            break  # every item is placed: the rest is text
        grid, token, interval = _describe(item, image_token, video_token, tokens_per_second)
        t, h, w = grid
        end = pos + t * h * w // merge**2
        if end > len(token_ids) or any(tok != token for tok in token_ids[pos:end]):
            kind = "video" if token == video_token else "image"
            raise ValueError(
                f"Item {len(spans)} ({kind}, grid {grid}) needs {end - pos} {kind} tokens "
                f"at prompt position {pos}."
            )
        spans.append((pos, end, grid, interval))
        pos = end
    if len(spans) != len(parts):
        raise ValueError(
            f"The prompt has {len(spans)} image or video placeholders for {len(parts)} items "
            "(a Qwen3-VL video's temporal patches counted apart)."
        )
    return spans


def _frame_groups(item: MRopeItem) -> list[MRopeItem]:
    """``[item]``, or, for a video whose placeholder holds text among its video tokens
    (Qwen3-VL: ``token_ids``), one grid ``(1, h, w)`` per temporal patch (HF's
    ``get_rope_index`` splits ``video_grid_thw`` so)."""
    if not isinstance(item, ProcessedImage) or item.token_ids is None or item.modality != "video":
        return [item]
    t, h, w = item.image_grid_thw
    return [replace(item, image_grid_thw=(1, h, w), token_ids=None) for _ in range(t)]


def _describe(
    item: MRopeItem, image_token: int, video_token: int | None, tokens_per_second: Any
) -> tuple[tuple[int, int, int], int, float | None]:
    """(grid, placeholder token, time interval) of one item."""
    if not isinstance(item, ProcessedImage):
        return tuple(item), image_token, None
    grid = tuple(item.image_grid_thw)
    if item.modality != "video":
        return grid, image_token, None
    if video_token is None:
        raise ValueError("A video was given, but the model has no video token.")
    if tokens_per_second is None or item.second_per_grid_t is None:
        return grid, video_token, None  # Qwen2-VL: consecutive temporal positions
    # As HF: the processor's second_per_grid_ts is a float32 tensor.
    interval = torch.tensor(item.second_per_grid_t, dtype=torch.float32) * tokens_per_second
    return grid, video_token, interval


def get_mrope_input_positions(
    prompt_token_ids: list[int],
    items: Sequence[MRopeItem],
    hf_config: Any,
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of a whole prompt: ``([3, len(prompt)] int64, mrope_position_delta)``.

    ``items`` are the prompt's images and videos in prompt order: an image's patch grid
    ``(t, h, w)`` (before the spatial merge), or its ``ProcessedImage`` (a video's gives its
    ``second_per_grid_t``); ``hf_config`` is the model's HF config (``image_token_id``,
    ``video_token_id``, ``vision_config.spatial_merge_size`` and, Qwen2.5-VL,
    ``vision_config.tokens_per_second``). A text-only prompt gives ``arange`` and delta 0.
    Raises ``ValueError`` if the placeholders do not match the items.
    """
    merge = hf_config.vision_config.spatial_merge_size
    spans = _spans(list(prompt_token_ids), items, hf_config, merge)
    num_tokens = len(prompt_token_ids)
    # numpy, not torch: a prompt's table is a few small CPU arrays, built once per request on
    # the engine's launch path, where each torch call's overhead would outweigh its work.
    positions = np.empty((3, num_tokens), dtype=np.int64)
    next_pos, cursor = 0, 0  # next text position; first prompt index not yet filled
    for start, end, (t, h, w), interval in spans:
        positions[:, cursor:start] = np.arange(next_pos, next_pos + start - cursor)
        next_pos += start - cursor
        times = np.arange(t)
        if interval is not None:  # float32 products truncated, as HF's tensors
            times = (torch.arange(t) * interval).long().numpy()
        # A view (the slice splits its contiguous last axis), filled axis by axis.
        grid = positions[:, start:end].reshape(3, t, h // merge, w // merge)
        grid[0] = times[:, None, None] + next_pos
        grid[1] = np.arange(h // merge)[:, None] + next_pos
        grid[2] = np.arange(w // merge) + next_pos
        next_pos += max(h, w) // merge
        cursor = end
    positions[:, cursor:] = np.arange(next_pos, next_pos + num_tokens - cursor)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return torch.from_numpy(positions), delta
