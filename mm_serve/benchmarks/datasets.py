"""Synthetic image+text requests for the benchmarks, like ``vllm bench``'s random dataset.

Each request is one user turn: ``input_len`` random common words (about one token each with
BPE tokenizers; the real prompt length is counted by the engine) and ``num_images`` images of
uniform random noise, then a fixed ``output_len``. Noise images never repeat, so the processor,
encoder and prefix caches get no hits (the 0%-hit workload) unless a test reuses a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image

_WORD_LIST = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give "
    "our under name very through just form sentence great think say help low line differ turn "
    "cause much mean before move right boy old too same tell does set three want air well also"
)
_WORDS = _WORD_LIST.split(" ")


@dataclass(frozen=True)
class BenchRequest:
    """One synthetic request: the user's text, its images (PIL, RGB) and the forced length."""

    prompt: str
    images: tuple[Image.Image, ...]
    output_len: int


def random_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """An RGB image of uniform random noise, ``width x height`` pixels."""
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def random_image_dataset(
    num_requests: int,
    input_len: int = 50,
    output_len: int = 128,
    image_size: tuple[int, int] = (448, 448),
    num_images: int = 1,
    seed: int = 0,
    max_image_size: tuple[int, int] | None = None,
) -> list[BenchRequest]:
    """``num_requests`` requests of ``input_len`` random words and ``num_images`` noise images
    of ``image_size`` (width, height) each, every one asking for ``output_len`` tokens. With
    ``max_image_size``, each image's width and height are drawn uniformly from
    ``image_size``'s up to ``max_image_size``'s (photos of varied sizes)."""
    words = random.Random(seed)
    pixels = np.random.default_rng(seed)
    high = max_image_size or image_size
    if any(lo > hi for lo, hi in zip(image_size, high, strict=True)):
        raise ValueError(f"max_image_size {high} is below image_size {image_size}.")

    def image() -> Image.Image:
        sides = zip(image_size, high, strict=True)
        width, height = (int(pixels.integers(lo, hi + 1)) for lo, hi in sides)
        return random_image(pixels, width, height)

    return [
        BenchRequest(
            prompt=" ".join(words.choice(_WORDS) for _ in range(input_len)),
            images=tuple(image() for _ in range(num_images)),
            output_len=output_len,
        )
        for _ in range(num_requests)
    ]


def openai_messages(request: BenchRequest) -> list[dict]:
    """The request as OpenAI chat messages: images as PNG data URLs (lossless, so their content
    hash is stable), then the text; built by the client SDK."""
    from mm_serve.client.images import user_message

    return [user_message(request.prompt, request.images)]
