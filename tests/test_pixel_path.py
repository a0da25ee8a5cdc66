"""uint8 pixels from the preprocessing pool, normalised on the engine's device.

The Qwen2-VL processor can stop before patchifying and normalising (``defer_normalization``):
the resized image stays uint8 ``[C, H, W]`` (an eighth of float32 patches' bytes across
processes and to the device), and ``patchify`` + ``normalize_patches`` finish it with the same
float32 operations, so the pixels the tower sees are bit-identical to the CPU's patches.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve.encoders.qwen2_vl_processor import (
    Qwen2VLImageProcessor,
    normalize_patches,
    patchify,
)
from mm_serve.models.qwen2_vl import pixels_on_device

VISION_CONFIG = SimpleNamespace(patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _images(seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = [(300, 200), (100, 500), (56, 56)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_normalisation_is_bit_identical(device) -> None:
    processor = Qwen2VLImageProcessor(max_pixels=28 * 28 * 64)
    for image in _images(0):
        final = processor.preprocess(image)
        raw = processor.preprocess(image, defer_normalization=True)
        assert final.pixel_values.dtype == torch.float32 and raw.pixel_values.dtype == torch.uint8
        assert raw.image_grid_thw == final.image_grid_thw and raw.num_tokens == final.num_tokens
        assert len(raw.pixel_mean) == len(raw.pixel_std) == 3 and final.pixel_mean == ()
        h, w = (side * 14 for side in raw.image_grid_thw[1:])
        assert raw.pixel_values.shape == (3, h, w)
        patches = patchify(raw.pixel_values.to(device), 14, 2, 2)
        out = normalize_patches(patches, raw.pixel_mean, raw.pixel_std)
        assert torch.equal(out.cpu(), final.pixel_values)


@pytest.mark.parametrize("device", DEVICES)
def test_pixels_on_device_concatenates_raw_and_final_images(device) -> None:
    processor = Qwen2VLImageProcessor(max_pixels=28 * 28 * 64)
    images = _images(1)
    final = [processor.preprocess(image) for image in images]
    raw = [processor.preprocess(image, defer_normalization=True) for image in images]
    expected = torch.cat([f.pixel_values for f in final])
    for batch in (raw, final, [raw[0], final[1], raw[2]]):
        out = pixels_on_device(batch, torch.device(device), VISION_CONFIG)
        assert out.device.type == device and out.dtype == torch.float32
        assert torch.equal(out.cpu(), expected)


def test_no_normalisation_config_stays_float() -> None:
    """A config with ``do_normalize`` off cannot defer: the patches come back final."""
    processor = Qwen2VLImageProcessor.from_config({"do_normalize": False}, max_pixels=28 * 28 * 16)
    raw = processor.preprocess(_images(2)[2], defer_normalization=True)
    assert raw.pixel_values.dtype == torch.float32 and raw.pixel_mean == ()
