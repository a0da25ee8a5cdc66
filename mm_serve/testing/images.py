"""The images of the model-family tests: real photographs shipped by installed packages
(``photo``), generated images of any size (``generated``), and the batch every family runs
against HF (``mixed_batch``: a text-only prompt, a photograph, several images in one prompt, a
grayscale photograph).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

TEXT_ONLY = "A text-only question about nothing in particular."

# A prompt with the family's image placeholders in its text, and its images in order.
Case = tuple[str, list[Image.Image]]


def photo(name: str) -> Image.Image:
    """A real photograph shipped inside an installed package: matplotlib's
    ``grace_hopper.jpg``, else scikit-image's ``data/<name>`` (``chelsea.png``,
    ``coffee.png``, ``astronaut.png``, ``rocket.jpg``...)."""
    if name == "grace_hopper.jpg":
        import matplotlib

        return Image.open(Path(matplotlib.get_data_path()) / "sample_data" / name)
    import skimage

    return Image.open(Path(skimage.__file__).parent / "data" / name)


def generated(width: int, height: int, seed: int) -> Image.Image:
    """A ``width x height`` RGB image of uniform random pixels (numpy's generator, ``seed``)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def processor_images() -> dict[str, Image.Image]:
    """The images a family's processor test compares with HF's, by test id: a photograph
    (grace_hopper.jpg), an odd size (301 x 87, generated) and a grayscale photograph
    (chelsea.png)."""
    return {
        "photograph": photo("grace_hopper.jpg"),
        "odd_size": generated(301, 87, 1),
        "grayscale": photo("chelsea.png").convert("L"),
    }


def mixed_batch(
    describe: str,
    compare: str,
    several: list[Image.Image],
    what: str,
    text_only: str = TEXT_ONLY,
) -> list[Case]:
    """The batch every family runs: ``text_only`` without images, ``describe`` with
    grace_hopper.jpg, ``compare`` with the images ``several`` and ``what`` with chelsea.png in
    grayscale (each text with the family's placeholders for its images)."""
    return [
        (text_only, []),
        (describe, [photo("grace_hopper.jpg")]),
        (compare, several),
        (what, [photo("chelsea.png").convert("L")]),
    ]
