"""Tiny, deterministic HF checkpoints for tests and samples (no download needed).

``build_tiny_checkpoint`` writes a folder that looks like a real Llama-3 or Qwen2 checkpoint:
a byte-level BPE tokenizer trained here on ``CORPUS`` with the family's special tokens and
chat template, ``config.json``, ``generation_config.json`` and safetensors weights (optionally
sharded with an index), all written by transformers' ``save_pretrained``. Weights are the HF
model's own init with a large ``initializer_range`` so that logits are peaked and greedy
decoding has no near-ties between implementations.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

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

_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "architecture": "LlamaForCausalLM",
        "model_type": "llama",
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
        "eos_ids": ["<|end_of_text|>", "<|eot_id|>"],
        "rope_theta": 500000.0,
        "tie": False,
    },
    "qwen2": {
        "architecture": "Qwen2ForCausalLM",
        "model_type": "qwen2",
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,  # as the real Qwen2 tokenizer: no BOS token
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "eos_ids": ["<|im_end|>", "<|endoftext|>"],
        "rope_theta": 1000000.0,
        "tie": True,
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

    spec = _FAMILIES[family]
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


def _build_config(family: str, tokenizer: Any, rope_scaling: dict | None, **overrides: Any):
    from transformers import AutoConfig

    spec = _FAMILIES[family]
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in spec["specials"]}
    values: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": spec["rope_theta"],
        "initializer_range": 0.3,
        "tie_word_embeddings": spec["tie"],
        "bos_token_id": ids.get(spec["bos"], ids[spec["pad"]]),
        "eos_token_id": [ids[name] for name in spec["eos_ids"]],
        "pad_token_id": ids[spec["pad"]],
        "architectures": [spec["architecture"]],
        "dtype": "float32",
    }
    if rope_scaling is not None:
        values["rope_scaling"] = dict(rope_scaling)
    values.update(overrides)
    return AutoConfig.for_model(spec["model_type"], **values)


def _perturb_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    """HF inits norms to 1 and biases to 0; randomise them so loading bugs cannot hide."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))


def _save_sharded(model: Any, path: str | os.PathLike, num_shards: int) -> None:
    """``model.save_pretrained`` into exactly ``num_shards`` safetensors files plus its index.

    transformers shards by a byte limit, not a count: search the limit (the count only falls
    as the limit grows) and save with it. Raises ``ValueError`` when no limit gives the count.
    """

    def save(max_shard_size: int) -> int:
        for stale in glob.glob(os.path.join(path, "model*.safetensors*")):  # a previous try's
            os.remove(stale)
        model.save_pretrained(path, max_shard_size=max_shard_size)
        return len(glob.glob(os.path.join(path, "*.safetensors")))

    low, high = 1, sum(p.numel() * p.element_size() for p in model.parameters())
    while low < high:  # the largest limit that still gives at least num_shards files
        middle = (low + high + 1) // 2
        low, high = (middle, high) if save(middle) >= num_shards else (low, middle - 1)
    if save(low) != num_shards:
        raise ValueError(f"transformers cannot split this model into {num_shards} shards.")


def build_tiny_checkpoint(
    path: str | os.PathLike,
    family: str = "llama",
    seed: int = 0,
    *,
    num_shards: int = 1,
    rope_scaling: dict | None = None,
    tie_word_embeddings: bool | None = None,
    **config_overrides: Any,
) -> str:
    """Write a tiny ``family`` ("llama" or "qwen2") checkpoint to ``path``; returns ``path``.

    Hidden 64, 2 layers, 4 heads, 2 KV heads (GQA), intermediate 128, 1024 positions, float32;
    Qwen2 ties its embeddings by default. ``rope_scaling`` is a HF rope dict (e.g.
    ``{"rope_type": "linear", "factor": 2.0}``); ``config_overrides`` go into the config.
    Same arguments, same bytes.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in _FAMILIES:
        raise ValueError(f"Unknown family {family!r}; choose from {sorted(_FAMILIES)}.")
    if tie_word_embeddings is not None:
        config_overrides["tie_word_embeddings"] = tie_word_embeddings
    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer(family)
    config = _build_config(family, tokenizer, rope_scaling, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms_and_biases(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    if num_shards > 1:
        _save_sharded(model, path, num_shards)
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
