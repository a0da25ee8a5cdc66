"""Content hash of a preprocessed image: the key of the encoder cache and of KV prefix blocks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:  # cache/ stays free of torch at run time
    from mm_serve.encoders.base import ProcessedImage

# Random per process, so hashes cannot be precomputed across deployments.
_SEED = int.from_bytes(os.urandom(8), "little")


def _frame(tag: bytes, payload: bytes) -> bytes:
    """Type tag + length + payload: no two different field sequences encode alike."""
    return tag + len(payload).to_bytes(8, "little") + payload


def hash_processed_image(model_id: str, image: ProcessedImage) -> str:
    """xxh3-128 hex digest of the model id, the pixel tensor (dtype, shape, bytes) and grid.

    Two images hash equally exactly when they yield the same pixels for the same model, so
    equal hashes imply equal embeddings.
    """
    pixels = image.pixel_values.contiguous()
    hasher = xxhash.xxh3_128(seed=_SEED)
    hasher.update(_frame(b"model", model_id.encode()))
    hasher.update(_frame(b"dtype", str(pixels.dtype).encode()))
    hasher.update(_frame(b"shape", repr(tuple(pixels.shape)).encode()))
    hasher.update(_frame(b"grid", repr(image.image_grid_thw).encode()))
    hasher.update(_frame(b"pixels", pixels.numpy().tobytes()))
    return hasher.hexdigest()
