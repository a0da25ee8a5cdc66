"""Incremental detokenization: multi-byte characters split across byte-level tokens."""

from __future__ import annotations

import random

import pytest

from mm_serve.checkpoint.dummy_processors import build_tokenizer
from mm_serve.frontend.detokenizer import IncrementalDetokenizer
from mm_serve.messages.sampling_params import SamplingParams

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


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deferred_text_is_the_streamed_text(family, skip_special_tokens):
    """A whole output decoded once (from ``output_token_ids``) reads as its tokens streamed one
    by one: random ids (special ones, ids past the vocabulary, halves of multi-byte characters
    among them), also ending inside a character, whose bytes the stream holds back."""
    tokenizer = build_tokenizer(family)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    prompt_ids = tokenizer("Say it:").input_ids
    text_ids = tokenizer(TEXT).input_ids
    rng = random.Random(0)
    cases = [text_ids, text_ids[:-1], text_ids[:3]]
    cases += [[rng.randrange(len(tokenizer) + 50) for _ in range(40)] for _ in range(300)]
    for output_ids in cases:
        streamed = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        collected: list[int] = []
        deferred = IncrementalDetokenizer(tokenizer, prompt_ids, params, collected)
        for token_id in output_ids:
            streamed.update([token_id])
            collected.append(token_id)
            assert deferred.update([token_id]) is None
        assert deferred.text == streamed.text
    assert IncrementalDetokenizer(tokenizer, prompt_ids, params, []).text == ""


def test_deferred_text_follows_later_tokens():
    tokenizer = build_tokenizer("qwen2")
    collected: list[int] = []
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(), collected)
    collected += tokenizer(" hello").input_ids
    assert detokenizer.text == " hello"
    collected += tokenizer(" world").input_ids
    assert detokenizer.text == " hello world"


def test_stop_strings_are_never_deferred():
    tokenizer = build_tokenizer("qwen2")
    params = SamplingParams(stop=["world"])
    detokenizer = IncrementalDetokenizer(tokenizer, [], params, [])
    assert detokenizer.update(tokenizer(" hello world again").input_ids) == "world"
    assert detokenizer.text == " hello "
