"""The geometry of LLaVA-OneVision's "anyres" images, shared by its image processor (pixels and
token counts) and its model (unpadding and downsampling the features).

An image alone in its prompt is resized to the best of ``image_grid_pinpoints`` (``(height,
width)`` multiples of the tile), padded and cut into ``rows x cols`` tiles after the base tile
(the whole image squashed to one). Each tile gives ``side x side`` features. The model lays the
grid's features out as one ``(rows * side) x (cols * side)`` map, crops the padding
(``unpadded_size``), shrinks it bilinearly beyond about ``max_tiles`` tiles
(``downsampled_size``) and appends ``image_newline`` to each row. Tokens: the base tile's
``side**2``, then the map row by row. An image among several is padded square and resized to
one tile: ``side**2`` features and one newline.

Formulas and float operations are transformers 5.23's (``select_best_resolution``,
``get_patch_output_size``, ``_get_unpadded_features``, ``pack_image_features``, ``unpad_image``),
so both sides agree with HF to the token."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

# ``ratio > DOWNSAMPLE_THRESHOLD`` (features / allowed features, square-rooted) shrinks the map.
DOWNSAMPLE_THRESHOLD = 1.1


def select_best_resolution(
    height: int, width: int, pinpoints: Sequence[Sequence[int]]
) -> tuple[int, int]:
    """The ``(height, width)`` pinpoint an image of ``height x width`` pixels is fitted into:
    the one keeping most of its pixels once fitted (never more than it has), then the one
    wasting least; the first of equals (HF's ``select_best_resolution``)."""
    best, best_effective, best_wasted = None, 0, float("inf")
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        fitted = int(width * scale) * int(height * scale)
        effective = min(fitted, width * height)
        wasted = pin_width * pin_height - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (pin_height, pin_width), effective, wasted
    if best is None:
        raise ValueError("image_grid_pinpoints is empty.")
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """``(height, width)`` of the image scaled to fit ``target`` with its aspect ratio, the
    scaled side rounded up (HF's ``get_patch_output_size``)."""
    target_height, target_width = target
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_height), target_width
    return target_height, min(math.ceil(width * scale_h), target_width)


def max_tiles(vision_aspect_ratio: str) -> int:
    """``N`` of ``"anyres_max_N"``: the most tiles of features an image keeps.

    Raises:
        ValueError: another form (HF reads only this one).
    """
    match = re.fullmatch(r"anyres_max_(\d+)", vision_aspect_ratio)
    if match is None:
        raise ValueError(
            f"Unsupported vision_aspect_ratio {vision_aspect_ratio!r}: expected 'anyres_max_N'."
        )
    return int(match.group(1))


def unpadded_crop(height: int, width: int, map_height: int, map_width: int) -> tuple[int, int]:
    """``(top, left)``: the rows cut at the top and at the bottom, and the columns cut at the
    left and at the right, of a ``map_height x map_width`` feature map of an image of
    ``height x width`` pixels, where the processor's padding lies (HF's ``unpad_image``)."""
    if width / height > map_width / map_height:
        new_height = int(round(height * (map_width / width), 7))
        return (map_height - new_height) // 2, 0
    new_width = int(round(width * (map_height / height), 7))
    return 0, (map_width - new_width) // 2


def downsampled_size(
    map_height: int, map_width: int, side: int, tiles: int
) -> tuple[int, int] | None:
    """The size the ``map_height x map_width`` map is bilinearly shrunk to, or None when it
    holds at most ``DOWNSAMPLE_THRESHOLD**2`` times ``tiles`` tiles of ``side**2`` features."""
    ratio = math.sqrt(map_height * map_width / (tiles * side**2))
    if ratio <= DOWNSAMPLE_THRESHOLD:
        return None
    return int(map_height // ratio), int(map_width // ratio)


@dataclass(frozen=True)
class AnyresLayout:
    """Where an image's features go: ``grid`` tiles ``(rows, cols)`` after the base tile;
    their map cropped by ``crop = (top, left)`` on each side to ``unpadded``, then resized to
    ``final`` (equal to ``unpadded`` when not downsampled), one newline per final row."""

    grid: tuple[int, int]
    crop: tuple[int, int]
    unpadded: tuple[int, int]
    final: tuple[int, int]
    side: int

    @property
    def num_tokens(self) -> int:
        rows, cols = self.final
        return self.side**2 + rows * (cols + 1)


def check_pinpoints(pinpoints: Sequence[Sequence[int]], tile: int) -> None:
    """Raises ValueError unless every pinpoint is a ``(height, width)`` of whole tiles."""
    if not pinpoints or any(
        len(p) != 2 or min(p) < tile or p[0] % tile or p[1] % tile for p in pinpoints
    ):
        raise ValueError(
            f"image_grid_pinpoints must be (height, width) multiples of the {tile}-pixel tile, "
            f"got {pinpoints}."
        )


def anyres_layout(
    height: int, width: int, pinpoints: Sequence[Sequence[int]], tile: int, side: int, tiles: int
) -> AnyresLayout:
    """The layout of an image of ``height x width`` pixels alone in its prompt: ``tile``
    pixels and ``side`` features per tile side, at most ``tiles`` tiles of features kept;
    ``pinpoints`` as ``check_pinpoints`` accepts them."""
    best_height, best_width = select_best_resolution(height, width, pinpoints)
    rows, cols = best_height // tile, best_width // tile
    map_height, map_width = rows * side, cols * side
    crop = unpadded_crop(height, width, map_height, map_width)
    unpadded = (map_height - 2 * crop[0], map_width - 2 * crop[1])
    final = downsampled_size(*unpadded, side, tiles) or unpadded
    return AnyresLayout((rows, cols), crop, unpadded, final, side)


def max_anyres_tokens(pinpoints: Sequence[Sequence[int]], tile: int, side: int, tiles: int) -> int:
    """An upper bound of ``AnyresLayout.num_tokens`` over all image sizes: for each pinpoint,
    every crop of its map along one axis (the unpadding keeps one axis whole and cuts the
    other equally on both sides)."""
    most = 0
    for pin_height, pin_width in pinpoints:
        map_height, map_width = pin_height // tile * side, pin_width // tile * side
        shapes = [(h, map_width) for h in range(map_height, -1, -2)]
        shapes += [(map_height, w) for w in range(map_width, -1, -2)]
        for shape in shapes:
            rows, cols = downsampled_size(*shape, side, tiles) or shape
            most = max(most, side**2 + rows * (cols + 1))
    return most
