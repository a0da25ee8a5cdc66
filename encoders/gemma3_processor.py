"""Gemma 3 image processor: one fixed-size image, and the prompt tokens it takes.

Pixels equal transformers' ``Gemma3ImageProcessor`` (torchvision backend, pan-and-scan off):
RGB, resize to ``size`` (bilinear, antialiased; no crop), rescale and normalise (mean and std
0.5).

The prompt: ``Gemma3Processor`` replaces each ``<start_of_image>`` by ``"\n\n<start_of_image>"
+ mm_tokens_per_image * "<image_soft_token>" + "<end_of_image>\n\n"``. The same ids come from
writing the newlines into the text around the placeholder (``prompt_text``, so they merge with
their neighbours as HF's do) and expanding the placeholder to the tags and soft tokens
(``ProcessedImage.token_ids``). A prompt given as token ids must hold those newlines itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from PIL import Image

from mm_serve.encoders.base import ProcessedImage
from mm_serve.encoders.clip_processor import CLIPImageProcessor
from mm_serve.encoders.image_io import Normalization

IMAGENET_STANDARD = (0.5, 0.5, 0.5)
BILINEAR = 2
NEWLINES = "\n\n"  # around each image in HF's expansion


@dataclass(kw_only=True, eq=False)
class Gemma3ImageProcessor(CLIPImageProcessor):
    """``preprocess`` gives ``[3, height, width]`` float32 and the image's placeholder tokens
    ``token_ids`` (``<start_of_image>``, the soft tokens, ``<end_of_image>``); ``placeholder``
    is the ``<start_of_image>`` text that ``prompt_text`` frames with newlines."""

    token_ids: tuple[int, ...]
    placeholder: str

    @classmethod
    def from_gemma3_config(
        cls, config: Mapping[str, Any], token_ids: tuple[int, ...], placeholder: str
    ) -> Gemma3ImageProcessor:
        """From image processor settings (``size`` as ``height``/``width``; bilinear, ImageNet
        standard statistics and no crop by default).

        Raises:
            ValueError: pan-and-scan turned on (not supported), or an unsupported ``size``.
        """
        if config.get("do_pan_and_scan"):
            raise ValueError("Gemma 3's pan-and-scan (do_pan_and_scan) is not supported.")
        defaults = {"image_mean": IMAGENET_STANDARD, "image_std": IMAGENET_STANDARD}
        return cls(
            num_tokens=len(token_ids),
            token_ids=tuple(token_ids),
            placeholder=placeholder,
            size=dict(config.get("size") or {"height": 224, "width": 224}),
            do_resize=bool(config.get("do_resize", True)),
            do_center_crop=False,
            resample=int(config.get("resample", BILINEAR)),
            normalization=Normalization.from_config({**defaults, **config}),
            do_convert_rgb=bool(config.get("do_convert_rgb", True)),
        )

    def preprocess(self, image: Image.Image, defer_normalization: bool = False) -> ProcessedImage:
        """PIL image (any mode) -> ``[3, height, width]`` float32, always normalised
        (``defer_normalization`` is not supported here), with the placeholder's tokens.

        Raises:
            ValueError: zero-sized image.
        """
        processed = super().preprocess(image)
        processed.token_ids = self.token_ids
        return processed

    def prompt_text(self, text: str) -> str:
        """``text`` with HF's newlines around each image placeholder (module doc)."""
        return text.replace(self.placeholder, NEWLINES + self.placeholder + NEWLINES)
