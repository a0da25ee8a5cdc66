"""VLM checkpoints as HF transformers writes them, and as real ones are shaped.

A checkpoint whose embedding has more rows than its tokenizer has tokens (as Qwen2-VL's 151936
rows against 151657 tokens) generates ids the tokenizer lacks: they decode to no text, greedy
tokens still match HF, and the sampler draws over every row.
"""

from __future__ import annotations

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.testing.vlm_checkpoints import build_tiny_vlm_checkpoint, tokenizer_size

MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def wide_vocab_path(tmp_path_factory) -> str:
    # Three quarters of the rows are ids the tokenizer lacks: greedy decoding lands on some.
    vocab_size = 4 * tokenizer_size("qwen2_vl")
    return build_tiny_vlm_checkpoint(
        tmp_path_factory.mktemp("wide"), "qwen2_vl", seed=1, vocab_size=vocab_size
    )


def test_vocab_size_below_tokenizer_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="below the tokenizer"):
        build_tiny_vlm_checkpoint(tmp_path, "llava", vocab_size=tokenizer_size("llava") - 1)


@torch.inference_mode()
def test_ids_beyond_the_tokenizer(wide_vocab_path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(wide_vocab_path)
    hf = AutoModelForImageTextToText.from_pretrained(wide_vocab_path, dtype=torch.float32).eval()
    assert hf.config.text_config.vocab_size == 4 * len(tokenizer)
    llm = LLM(wide_vocab_path)
    prompts = ["A harbor town", "The committee met", "Light travels"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    unknown = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt).input_ids
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        completion = output.outputs[0]
        assert completion.token_ids == ref[0, len(ids) :].tolist()
        # An id the tokenizer lacks adds no text (nor does an unfinished UTF-8 character at the
        # end, which the incremental decoder holds back).
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.text == text.rstrip("\ufffd")
        unknown += sum(t >= len(tokenizer) for t in completion.token_ids)
    assert unknown > 0  # the case this test is about did occur
    # Sampling covers every row: with a flat temperature, ids beyond the tokenizer come up.
    sampled = llm.generate(
        prompts[0], SamplingParams(temperature=5.0, max_tokens=64, seed=0, ignore_eos=True)
    )[0].outputs[0]
    assert max(sampled.token_ids) >= len(tokenizer)
