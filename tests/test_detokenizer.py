"""Incremental detokenization: multi-byte characters split across byte-level tokens."""

from __future__ import annotations

from mm_serve.frontend.detokenizer import IncrementalDetokenizer
from mm_serve.sampling_params import SamplingParams
from mm_serve.testing.checkpoints import build_tokenizer

TEXT = "Grüße aus Zürich 🚀 — 東京 café 👩‍🔬 done"


def test_multibyte_characters_split_across_tokens_stream_whole():
    tokenizer = build_tokenizer("qwen2")
    prompt_ids = tokenizer("Say it:").input_ids
    output_ids = tokenizer(TEXT).input_ids
    # The tiny vocabulary has no merges for these characters: each is several byte tokens.
    assert len(output_ids) > len(TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    pieces = []
    for token_id in output_ids:  # one token per step, as the engine produces them
        before = detokenizer.text
        detokenizer.update([token_id])
        pieces.append(detokenizer.text[len(before) :])
    assert "".join(pieces) == TEXT == tokenizer.decode(output_ids)
    assert all("\ufffd" not in piece for piece in pieces)  # never half a character
    assert sum(1 for piece in pieces if not piece) > 0  # some tokens wait for the rest


def test_stop_string_inside_multibyte_text():
    tokenizer = build_tokenizer("qwen2")
    params = SamplingParams(stop=["東京"])
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer("x").input_ids, params)
    stop = None
    for token_id in tokenizer(TEXT).input_ids:
        stop = detokenizer.update([token_id])
        if stop:
            break
    assert stop == "東京" and detokenizer.text == "Grüße aus Zürich 🚀 — "


def test_tokens_without_text_leave_the_text_intact():
    """An id beyond the tokenizer (real checkpoints have more embedding rows than tokens) and
    a skipped special token add no text, and the text around them decodes as without them."""
    tokenizer = build_tokenizer("qwen2")
    unknown, special = len(tokenizer) + 7, tokenizer.eos_token_id
    words = tokenizer(" hello world").input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer("x").input_ids, SamplingParams())
    pieces = []
    for token_id in [words[0], unknown, special, *words[1:], unknown]:
        before = detokenizer.text
        assert detokenizer.update([token_id]) is None
        pieces.append(detokenizer.text[len(before) :])
    assert detokenizer.text == " hello world"
    assert pieces[1] == pieces[2] == pieces[-1] == ""
