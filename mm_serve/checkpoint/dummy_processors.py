"""Small tokenizers and HF processors of each model family, made here without a download.

A real vocabulary cannot be shipped offline, so the tiny test checkpoints and the benchmarks'
weightless architecture folders (``mm_serve.benchmarks.architectures``) share these stand-ins:
a byte-level BPE (``build_tokenizer``: Llama's or Qwen2's special tokens and chat template; Gemma:
a SentencePiece-style BPE) trained on ``CORPUS``, deterministic, plus each vision family's image
tokens and chat template (``vlm_tokenizer``, ``internvl_tokenizer``, ``onevision_tokenizer``,
``idefics3_tokenizer``, ``gemma3_tokenizer``), and transformers' processor of the family built
with the image settings a caller gives (the tiny checkpoints' or the published ones).
"""

from __future__ import annotations

from typing import Any

from mm_serve.utils._compat import ensure_torchvision_importable

CORPUS = [
    "The harbor town woke slowly. Fishing boats slid past the breakwater while gulls argued "
    "over the morning catch, and the baker on the corner pulled the first loaves from an oven "
    "that had been burning since four o'clock.",
    "A neural network is a function with many parameters. Training adjusts those parameters "
    "so that the outputs match examples; inference simply evaluates the function on new "
    "inputs, one token or one image at a time.",
    "To make a simple tomato soup, soften an onion in olive oil, add chopped tomatoes, a pinch "
    "of salt and a cup of water, then simmer for twenty minutes and blend until smooth.",
    "The committee met on Tuesday, 14 March, to review the budget: 3,250 euros for equipment, "
    "1,100 for travel, and 475 for printing. Questions? Email the secretary before Friday!",
    "Mountains are older than they look. Rain, ice and wind wear them down grain by grain, "
    "while slow collisions of the plates beneath push new ridges up into the clouds.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
    "She asked the robot what it could see. It described a red bicycle leaning against a "
    "white fence, a dog asleep in the shade, and two children drawing with chalk.",
    "Light travels about three hundred thousand kilometres per second, so sunlight takes "
    "roughly eight minutes to reach the Earth and a little over one second to reach the Moon.",
]

TEXT_TOKENIZERS: dict[str, dict[str, Any]] = {
    "llama": {
        "specials": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": "<|end_of_text|>",
    },
    "qwen2": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,  # as the real Qwen2 tokenizer: no BOS token
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
    },
}

# Message content is a string or a list of OpenAI-style parts (text parts are kept).
_CONTENT_MACRO = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- else -%}"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
)
CHAT_TEMPLATES = {
    "llama": _CONTENT_MACRO + "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{{- render(message['content']) | trim -}}{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}",
    "qwen2": _CONTENT_MACRO + "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) -}}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
}


def train_byte_level_bpe(
    corpus: list[str],
    vocab_size: int,
    specials: list[str],
    bos: str | None,
    qwen2_pre_tokenizer: bool = False,
) -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE of ``vocab_size`` tokens trained on
    ``corpus`` (deterministic), then the special tokens ``specials``; ``bos`` (one of them),
    when given, is prepended when encoding. Pre-tokenizer: Qwen2's (NFC, its split regex,
    then bytes; transformers' Qwen2Tokenizer re-creates it on load anyway) with
    ``qwen2_pre_tokenizer``, else the byte-level one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if qwen2_pre_tokenizer:
        from tokenizers import Regex, normalizers
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(specials)
    if bos is not None:
        prepend_bos(tok, bos)
    return tok


def prepend_bos(tok: Any, bos: str) -> None:
    """Make ``tokenizers.Tokenizer`` ``tok`` prepend its special token ``bos`` when encoding."""
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )


def build_tokenizer(family: str = "llama", vocab_size: int = 400) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``CORPUS`` (deterministic).

    The family's special tokens come after the learned vocabulary, as in the real ones; the
    Llama tokenizer prepends ``<|begin_of_text|>`` when encoding, the Qwen2 one adds nothing.
    """
    from transformers import PreTrainedTokenizerFast

    spec = TEXT_TOKENIZERS[family]
    tok = train_byte_level_bpe(
        CORPUS, vocab_size, spec["specials"], spec["bos"], qwen2_pre_tokenizer=family == "qwen2"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec["bos"],
        eos_token=spec["eos"],
        pad_token=spec["pad"],
        chat_template=CHAT_TEMPLATES[family],
    )


def family_tokenizer(text_family: str, specials: list[str], chat_template: str) -> Any:
    """The text builder's ``text_family`` tokenizer ("llama" or "qwen2") plus a vision family's
    special tokens ``specials`` (ids after the text ones, in order) and its chat template."""
    tokenizer = build_tokenizer(text_family)
    tokenizer.add_tokens(specials, special_tokens=True)
    tokenizer.chat_template = chat_template
    return tokenizer


QWEN_VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LLAVA_IMAGE_TOKEN = "<image>"

# As Qwen2-VL-Instruct's template: image parts become <|vision_start|><|image_pad|><|vision_end|>
# (the processor repeats <|image_pad|> once per image token), video parts the same with
# <|video_pad|>.
QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Vicuna style, as llava-1.5-hf: "USER: <image>\nWhat is this? ASSISTANT:" (the tokenizer adds
# the BOS token).
LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] + ' ' -}}"
    "{%- else -%}{{- message['role'].upper() + ': ' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<image>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- ' ' if message['role'] == 'user' else '</s>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
)


def qwen_vl_image_token_ids(tokenizer: Any) -> dict[str, int]:
    """config.json's image and video token ids of a tokenizer with ``QWEN_VL_SPECIALS``."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def vlm_tokenizer(family: str) -> Any:
    """The text builder's tokenizer plus the family's image tokens and chat template."""
    if family == "llava":
        return family_tokenizer("llama", [LLAVA_IMAGE_TOKEN], LLAVA_CHAT_TEMPLATE)
    return family_tokenizer("qwen2", QWEN_VL_SPECIALS, QWEN_VL_CHAT_TEMPLATE)


# InternVL3

# The tokenizer's named image tokens, as InternVL3-*-hf's tokenizer_config.json names them.
INTERNVL_IMAGE_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}

# As InternVL3-*-hf's template, shortened (no system prompt): an image part renders as
# "<IMG_CONTEXT>\n", which the processor expands to <img>, the tiles' tokens and </img>.
INTERNVL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<IMG_CONTEXT>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def internvl_tokenizer() -> Any:
    """The Qwen2 text builder's tokenizer plus InternVL's named image tokens and chat template."""
    base = build_tokenizer("qwen2")
    base.add_tokens(list(INTERNVL_IMAGE_TOKENS.values()), special_tokens=True)
    # Named special tokens are set when a tokenizer is made: make it again around the same
    # backend, as from_pretrained does from tokenizer_config.json's "extra_special_tokens".
    return type(base)(
        tokenizer_object=base.backend_tokenizer,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        extra_special_tokens=dict(INTERNVL_IMAGE_TOKENS),
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )


def internvl_processor(tokenizer: Any, tile: int, image_seq_length: int) -> Any:
    """transformers' ``InternVLProcessor``: GotOcr2's image processor with InternVL3's settings
    (ImageNet statistics, bicubic, ``tile x tile``, GotOcr2's default 1 to 12 tiles)."""
    ensure_torchvision_importable()
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    settings = dict(
        size={"height": tile, "width": tile},
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(**settings),
        video_processor=InternVLVideoProcessor(**settings),
        tokenizer=tokenizer,
        image_seq_length=image_seq_length,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )


# LLaVA-OneVision

ONEVISION_SPECIALS = ["<image>", "<video>"]

# The llava-hf conversion's template (images first, then videos, then the text of a message),
# also rendering OpenAI-style image_url parts as an image.
ONEVISION_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<image>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def onevision_tokenizer() -> Any:
    """The Qwen2 text builder's tokenizer plus ``<image>``, ``<video>`` and the template."""
    return family_tokenizer("qwen2", ONEVISION_SPECIALS, ONEVISION_CHAT_TEMPLATE)


def onevision_processor(
    tokenizer: Any,
    tile: int,
    pinpoints: list[list[int]],
    num_image_tokens: int,
    vision_aspect_ratio: str,
) -> Any:
    """transformers' ``LlavaOnevisionProcessor`` with ``tile x tile`` tiles, SigLIP's mean and
    std (0.5) and bicubic resizing, as the published checkpoints have it; ``pinpoints``: the
    grids of tiles (``[height, width]`` in pixels) an image may be resized to, ``num_image_tokens``
    per tile."""
    ensure_torchvision_importable()
    from transformers import (
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    size = {"height": tile, "width": tile}
    half = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    image_processor = LlavaOnevisionImageProcessor(
        size=size, image_grid_pinpoints=pinpoints, **half
    )
    return LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size=size, **half),
        num_image_tokens=num_image_tokens,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=vision_aspect_ratio,
        chat_template=ONEVISION_CHAT_TEMPLATE,
    )


# Idefics3 (SmolVLM)

IDEFICS3_SPECIALS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]

# As SmolVLM-Instruct's template, shortened: "<|im_start|>User:<image>Hi<end_of_utterance>\n
# Assistant:" (image parts render as <image>, which the processor expands).
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{%- for message in messages -%}"
    "{{- message['role'] | capitalize -}}"
    "{%- if message['content'] is string -%}{{- ': ' + message['content'] -}}"
    "{%- else -%}{{- ':' if message['content'][0]['type'] == 'image' else ': ' -}}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_utterance>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)


def idefics3_tokenizer() -> Any:
    """The Llama text builder's tokenizer plus Idefics3's special tokens and chat template."""
    return family_tokenizer("llama", IDEFICS3_SPECIALS, IDEFICS3_CHAT_TEMPLATE)


def idefics3_processor(tokenizer: Any, tile: int, longest_edge: int, image_seq_len: int) -> Any:
    """transformers' ``Idefics3Processor``: images resized to ``longest_edge`` at most, cut into
    ``tile x tile`` tiles (plus the global image), ``image_seq_len`` image tokens per tile."""
    ensure_torchvision_importable()
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile}
    )
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=image_seq_len,
        chat_template=IDEFICS3_CHAT_TEMPLATE,
    )


# Gemma 3

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
