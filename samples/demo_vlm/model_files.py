"""The demo VLM's architecture, tokenizer and processor files, and batched preprocessing.

The checkpoint is an ordinary Qwen2-VL one (``Qwen2VLForConditionalGeneration``), only small; its
``model/config.json`` is the architecture (text hidden 256, 4 layers, 4 heads, 2 KV heads; vision
tower width 192, 4 layers, patch 14, 2 x 2 merge), which ``build_config`` rebuilds for a retrained
tokenizer. A 224 x 224 image is 16 x 16 patches, i.e. 64 image tokens. The tokenizer is a byte-level
BPE with Qwen2's pre-tokenizer, trained on the task's questions and answers, plus Qwen2-VL's special
tokens and chat template (from ``mm_serve.checkpoint.dummy_processors``), so any text tokenizes and
chat messages with ``image_url`` parts work.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from mm_serve.checkpoint.dummy_processors import (
    CORPUS,
    QWEN_VL_CHAT_TEMPLATE,
    QWEN_VL_SPECIALS,
    qwen_vl_image_token_ids,
)

PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224  # every input image: 4 to 64 image tokens
# OpenAI CLIP's statistics, as Qwen2-VL's image processor.
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)
# The shipped checkpoint: its config.json is the architecture that build_config rebuilds.
MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")


def build_tokenizer(corpus: list[str], vocab_size: int = 640) -> Any:
    """A byte-level BPE over ``corpus`` (plus the general test corpus) with Qwen2's
    pre-tokenizer and Qwen2-VL's special tokens; deterministic for a given corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) + CORPUS, trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )
    tokenizer.add_tokens(QWEN_VL_SPECIALS, special_tokens=True)
    return tokenizer


def build_config(tokenizer: Any) -> Any:
    """The shipped checkpoint's architecture (``model/config.json``: the sizes, the rotary
    split, tied embeddings) with ``tokenizer``'s vocabulary and special token ids."""
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig.from_pretrained(MODEL_DIR)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    ids = {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad}
    config.text_config.update({**ids, "vocab_size": len(tokenizer)})
    config.update(qwen_vl_image_token_ids(tokenizer))
    return config


def build_model(tokenizer: Any, seed: int) -> Any:
    """A freshly initialised float32 ``Qwen2VLForConditionalGeneration`` (seeded)."""
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    config = build_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    text = config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    )
    return model


def save_checkpoint(model: Any, tokenizer: Any, path: str, card: dict[str, Any]) -> None:
    """Write the HF folder exactly as transformers' ``save_pretrained`` lays it out (config,
    float32 safetensors, generation config; the processor's ``processor_config.json`` with
    the image processor's ``min_pixels``/``max_pixels`` inside, tokenizer files, chat
    template), plus ``training.json``, the training record."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from mm_serve.utils._compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    os.makedirs(path, exist_ok=True)
    model.to(torch.float32).save_pretrained(path)
    pixels = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixels),
        video_processor=Qwen2VLVideoProcessor(**pixels),
        tokenizer=tokenizer,
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    with open(os.path.join(path, "training.json"), "w") as f:
        json.dump(card, f, indent=2, sort_keys=True)
        f.write("\n")


def pixel_values(images: torch.Tensor) -> torch.Tensor:
    """``[B, H, W, 3]`` uint8 (H, W multiples of 28) → Qwen2-VL ``pixel_values``
    ``[B * H/14 * W/14, 3 * 2 * 14 * 14]`` float32, rows in the processor's order (each 2 x 2
    block of patches together; a still image is its frame twice). No resize: equal to the HF
    processor's output for images already inside ``[MIN_PIXELS, MAX_PIXELS]``."""
    b, h, w, c = images.shape
    mean = torch.tensor(MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=images.device).view(1, 3, 1, 1)
    x = (images.permute(0, 3, 1, 2).float() / 255.0 - mean) / std  # [B, 3, H, W]
    gh, gw = h // PATCH, w // PATCH
    x = x.reshape(b, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # [B, gh/m, gw/m, m, m, C, patch, patch]
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, TEMPORAL, -1, -1)
    return x.reshape(b * gh * gw, c * TEMPORAL * PATCH * PATCH)
