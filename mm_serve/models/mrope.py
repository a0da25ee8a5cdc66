"""Multimodal RoPE positions (M-RoPE) of a prompt for Qwen2-VL and Qwen2.5-VL.

M-RoPE (Qwen2-VL paper, arXiv:2409.12191, section 2.1) gives every token three positions:
temporal, height, width. Text tokens have all three equal and count up by one. The tokens
of an image (a ``t x (h / merge) x (w / merge)`` grid of merged patches) all start from the
position ``p`` after the preceding text: token ``(i, j, k)`` of the grid gets
``(p + i, p + j, p + k)``; the text after the image resumes at ``p + max(h, w) / merge``.
Same result as HF ``Qwen2VLModel.get_rope_index`` for images (videos are not supported).

Because an image takes fewer positions than tokens, the last position of a prompt is below
``len(prompt) - 1``; ``mrope_position_delta`` (<= 0) is that shift: the token at sequence
index ``i >= len(prompt)`` (decode) has position ``i + delta`` on all three axes.
"""

from __future__ import annotations

from typing import Any

import torch


def _image_spans(
    token_ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]], merge: int
) -> list[tuple[int, int, tuple[int, int, int]]]:
    """``(start, end, grid_thw)`` of each image's placeholder run, in prompt order.

    Each image takes ``t * h * w // merge**2`` consecutive image tokens (two adjacent images
    are told apart by their sizes). Raises ``ValueError`` if the runs do not match ``grids``.
    """
    spans = []
    pos, grid_iter = 0, iter(grids)
    while pos < len(token_ids):
        if token_ids[pos] != image_token_id:
            pos += 1
            continue
        grid = next(grid_iter, None)
        if grid is None:
            raise ValueError(f"More image tokens in the prompt than the {len(grids)} images.")
        t, h, w = grid
        end = pos + t * h * w // merge**2
        if end > len(token_ids) or any(tok != image_token_id for tok in token_ids[pos:end]):
            raise ValueError(f"Image {len(spans)} (grid {grid}) needs {end - pos} image tokens.")
        spans.append((pos, end, (t, h, w)))
        pos = end
    if len(spans) != len(grids):
        raise ValueError(f"The prompt has {len(spans)} image placeholders for {len(grids)} images.")
    return spans


def get_mrope_input_positions(
    prompt_token_ids: list[int],
    image_grid_thws: list[tuple[int, int, int]],
    hf_config: Any,
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of a whole prompt: ``([3, len(prompt)] int64, mrope_position_delta)``.

    ``image_grid_thws`` are the images' patch grids ``(t, h, w)`` (before the spatial merge),
    in prompt order; ``hf_config`` is the model's HF config (``image_token_id``,
    ``vision_config.spatial_merge_size``). A text-only prompt gives ``arange`` and delta 0.
    Raises ``ValueError`` if the image placeholders do not match the grids.
    """
    merge = hf_config.vision_config.spatial_merge_size
    spans = _image_spans(
        list(prompt_token_ids), hf_config.image_token_id, list(image_grid_thws), merge
    )
    num_tokens = len(prompt_token_ids)
    positions = torch.empty(3, num_tokens, dtype=torch.int64)
    next_pos, cursor = 0, 0  # next text position; first prompt index not yet filled
    for start, end, (t, h, w) in spans:
        positions[:, cursor:start] = torch.arange(next_pos, next_pos + start - cursor)
        next_pos += start - cursor
        grid = torch.meshgrid(
            torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij"
        )
        positions[:, start:end] = torch.stack(grid).reshape(3, -1) + next_pos
        next_pos += max(h, w) // merge
        cursor = end
    positions[:, cursor:] = torch.arange(next_pos, next_pos + num_tokens - cursor)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta
