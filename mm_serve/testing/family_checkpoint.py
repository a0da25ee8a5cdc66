"""What every tiny vision-language checkpoint builder does alike.

A builder makes its family's tokenizer, config and processor; these functions do the rest the
same way for each family: add the special tokens to the text builder's tokenizer, set the
text config's token ids, check the requested ``vocab_size`` against the tokenizer, make the
HF model with a fixed seed and random norms and biases, draw the projector's weights small,
and write the folder (weights,
``generation_config.json`` with the text config's token ids, the processor's files with its
tokenizer's), every file by transformers' own ``save_pretrained``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mm_serve.testing.checkpoints import _perturb_norms_and_biases, build_tokenizer

# The tiled families' towers (SigLIP, InternViT) at toy size: width 32, MLP 64, 2 layers of 2
# heads; each family adds its tile and patch sizes.
TINY_VISION: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
)
# The projector's init std: HF inits it with the text std (0.3 in the tiny configs), which
# makes image embeddings ~10x larger than token embeddings and float32 rounding visible in the
# logits.
PROJECTOR_STD = 0.05


def family_tokenizer(text_family: str, specials: list[str], chat_template: str) -> Any:
    """The text builder's ``text_family`` tokenizer ("llama" or "qwen2") plus a vision family's
    special tokens ``specials`` (ids after the text ones, in order) and its chat template."""
    tokenizer = build_tokenizer(text_family)
    tokenizer.add_tokens(specials, special_tokens=True)
    tokenizer.chat_template = chat_template
    return tokenizer


def text_token_ids(
    tokenizer: Any, vocab_size: int | None, eos_token_ids: list[int] | None = None
) -> dict[str, Any]:
    """The text config's ``vocab_size`` (``checked_vocab_size``) and token ids: BOS (the pad
    token where the tokenizer has none, as Qwen2's), pad, and EOS, by default the tokenizer's
    EOS and its pad token (both end a generation), else ``eos_token_ids``.

    Raises:
        ValueError: ``vocab_size`` below the tokenizer's length.
    """
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if eos_token_ids is None:
        eos_token_ids = [eos] + ([pad] if pad != eos else [])
    return {
        "vocab_size": checked_vocab_size(tokenizer, vocab_size),
        "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else pad,
        "eos_token_id": eos_token_ids,
        "pad_token_id": pad,
    }


def checked_vocab_size(tokenizer: Any, vocab_size: int | None) -> int:
    """``vocab_size`` (the embedding and LM-head rows), by default the tokenizer's length.

    Raises:
        ValueError: ``vocab_size`` below the tokenizer's length (ids it encodes would have no
            row).
    """
    if vocab_size is None:
        return len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tokenizer)}.")
    return vocab_size


def random_model(model_class: type, config: Any, seed: int) -> Any:
    """``model_class(config)`` in float32 and eval mode: HF's init drawn after seeding torch
    with ``seed``, then the norms and biases perturbed (HF inits them to 1 and 0, which would
    hide loading bugs). Same arguments, same weights."""
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    _perturb_norms_and_biases(model, seed)
    return model


@torch.no_grad()
def shrink_projector(*linears: torch.nn.Linear) -> None:
    """Redraw the projector's weights ``linears`` with std ``PROJECTOR_STD`` (torch's global
    generator): image embeddings about as large as token embeddings."""
    for linear in linears:
        linear.weight.normal_(0.0, PROJECTOR_STD)


def save_checkpoint(path: str | os.PathLike, model: Any, processor: Any) -> str:
    """Give ``model`` a generation config with its text config's BOS, EOS and pad ids, and
    write it and ``processor`` (with its tokenizer and chat template) into ``path`` (created
    if needed). Returns ``path``."""
    from transformers import GenerationConfig

    text = model.config.get_text_config()
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    )
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)
