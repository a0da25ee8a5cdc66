"""A tiny Gemma 3 checkpoint for tests, written by transformers' ``save_pretrained``.

Text: a SentencePiece-style BPE tokenizer trained here on ``CORPUS`` and lines of newlines
(so that ``"\\n\\n\\n"`` is one token, as in Gemma's vocabulary, and HF's newlines around an
image merge with the prompt's own newlines), Gemma's special tokens (``<bos>``, ``<eos>``,
``<start_of_turn>``, ``<end_of_turn>``, ``<start_of_image>``, ``<end_of_image>``,
``<image_soft_token>``) and a Gemma-style chat template. LM: hidden 64, 4 layers (``sliding,
full, sliding, sliding``: four KV-cache groups of one layer), a sliding window of
``GEMMA3_SLIDING_WINDOW`` tokens, so that prompts exceed it; tied embeddings. Vision: a
SigLIP tower of width 32 on 48 x 48 images of 8-pixel patches (6 x 6), pooled to
``GEMMA3_MM_TOKENS`` = 9 tokens per image.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mm_serve._compat import ensure_torchvision_importable
from mm_serve.testing.checkpoints import CORPUS, prepend_bos
from mm_serve.testing.family_checkpoint import (
    TINY_VISION,
    checked_vocab_size,
    random_model,
    save_checkpoint,
)

GEMMA3_IMAGE_SIZE, GEMMA3_PATCH = 48, 8
GEMMA3_MM_TOKENS = 9  # 3 x 3 pooled from 6 x 6 patches
GEMMA3_SLIDING_WINDOW = 12
GEMMA3_LAYER_TYPES = [
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "sliding_attention",
]
GEMMA3_SPECIALS = {
    "pad_token": "<pad>",
    "eos_token": "<eos>",
    "bos_token": "<bos>",
}
GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
GEMMA3_TURNS = ["<start_of_turn>", "<end_of_turn>"]

# As Gemma 3's template, shortened: "<bos><start_of_turn>user\n<start_of_image>What?
# <end_of_turn>\n<start_of_turn>model\n" (assistant turns are "model").
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<start_of_image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
NEWLINE_LINES = ["a\nb\n\nc\n\n\nd\n\n\n\ne", "one\n\n\ntwo\n\nthree\n\n\n\nfour\nfive"] * 20


def gemma3_tokenizer(vocab_size: int = 400) -> Any:
    """A tokenizer of Gemma's kind, trained on ``CORPUS`` and ``NEWLINE_LINES``
    (``sentencepiece_style_bpe``), with Gemma's special tokens: it prepends ``<bos>``, and
    knows ``<start_of_image>`` and the others as the ``boi_token``, ``eoi_token`` and
    ``image_token`` that ``Gemma3Processor`` reads."""
    from transformers import PreTrainedTokenizerFast

    specials = [*GEMMA3_SPECIALS.values(), *GEMMA3_TURNS, *GEMMA3_IMAGE_TOKENS.values()]
    tok = sentencepiece_style_bpe(CORPUS + NEWLINE_LINES, vocab_size, specials)
    prepend_bos(tok, GEMMA3_SPECIALS["bos_token"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **GEMMA3_SPECIALS,
        extra_special_tokens=dict(GEMMA3_IMAGE_TOKENS),
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )


def sentencepiece_style_bpe(corpus: list[str], vocab_size: int, specials: list[str]) -> Any:
    """A ``tokenizers.Tokenizer`` spelled as Gemma's (SentencePiece BPE): spaces become "▁",
    text is split before each "▁" and around each run of newlines, BPE of ``vocab_size``
    learned tokens trained on ``corpus`` (deterministic), then the 256 byte tokens
    ``<0x00>``...``<0xFF>`` for characters outside it (byte fallback), then ``specials``.
    Unlike a byte-level vocabulary (where "\\n" is "Ċ"), whitespace runs such as "\\n\\n" are
    entries under their own text, which vLLM's Gemma 3 processor looks up."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    newlines = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [newlines, pre_tokenizers.Metaspace(prepend_scheme="never")]
    )
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok.model = models.BPE(vocab, merges, byte_fallback=True)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(specials)
    return tok


def _config(tokenizer: Any, text: dict[str, Any], vocab_size: int) -> Any:
    from transformers import Gemma3Config

    ids = tokenizer.convert_tokens_to_ids
    end_of_turn = ids("<end_of_turn>")
    text_config = dict(
        text,
        model_type="gemma3_text",
        num_hidden_layers=len(GEMMA3_LAYER_TYPES),
        layer_types=list(GEMMA3_LAYER_TYPES),
        head_dim=16,
        query_pre_attn_scalar=24,  # not head_dim: a wrong scale shows
        sliding_window=GEMMA3_SLIDING_WINDOW,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, end_of_turn],
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        **TINY_VISION,
        model_type="siglip_vision_model",
        image_size=GEMMA3_IMAGE_SIZE,
        patch_size=GEMMA3_PATCH,
        vision_use_head=False,
    )
    return Gemma3Config(
        text_config=text_config,
        vision_config=vision,
        mm_tokens_per_image=GEMMA3_MM_TOKENS,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        architectures=["Gemma3ForConditionalGeneration"],
    )


def gemma3_processor(tokenizer: Any, image_size: int, mm_tokens_per_image: int) -> Any:
    """transformers' ``Gemma3Processor``: ``Gemma3ImageProcessor`` at ``image_size`` squared
    (its defaults otherwise), ``mm_tokens_per_image`` soft tokens per image, the template."""
    ensure_torchvision_importable()
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    size = {"height": image_size, "width": image_size}
    return Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size=size),
        tokenizer=tokenizer,
        image_seq_length=mm_tokens_per_image,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )


@torch.no_grad()
def _amplify_layers(model: torch.nn.Module, boost: float = 4.0) -> None:
    """Add ``boost`` to the LM's post-attention and post-MLP norm weights: otherwise the token
    embeddings (scaled by ``sqrt(hidden)``, tied to the LM head) outweigh what the layers add,
    and greedy decoding repeats the last prompt token whatever the model computes."""
    for name, param in model.model.language_model.named_parameters():
        if "post_attention_layernorm" in name or "post_feedforward_layernorm" in name:
            param.add_(boost)


def build_tiny_gemma3_checkpoint(
    path: str | os.PathLike, text: dict[str, Any], seed: int, vocab_size: int | None
) -> str:
    """Write the tiny Gemma 3 checkpoint to ``path`` with the text config ``text`` (tiny
    sizes; layers, window and token ids are set here). Returns ``path``.

    Raises:
        ValueError: ``vocab_size`` below the tokenizer's length.
    """
    from transformers import Gemma3ForConditionalGeneration

    tokenizer = gemma3_tokenizer()
    config = _config(tokenizer, text, checked_vocab_size(tokenizer, vocab_size))
    model = random_model(Gemma3ForConditionalGeneration, config, seed)
    with torch.no_grad():  # HF inits it to zeros: no image would reach the LM
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.05)
    _amplify_layers(model)  # on top of random_model's perturbed norms
    processor = gemma3_processor(tokenizer, GEMMA3_IMAGE_SIZE, GEMMA3_MM_TOKENS)
    return save_checkpoint(path, model, processor)
