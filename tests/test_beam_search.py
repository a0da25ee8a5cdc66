"""Beam search (``mm_serve.frontend.beam_search``, ``LLM.beam_search``) against HF transformers'
``generate(num_beams=...)`` on the tiny random-weight checkpoints (float32), as vLLM's
tests/samplers/test_beam_search.py checks it: the same sequences in the same order, with
the same scores; and the beams sharing their prefix's KV blocks through the prefix cache.

A copy of each checkpoint whose ``generation_config.json`` makes two frequent tokens stop
tokens as well has many beams end early: stop tokens, length penalties and HF's early-stopping
heuristic all change the result there.
"""

from __future__ import annotations

import collections
import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve import LLM, BeamSearchParams
from mm_serve.frontend.beam_search import BeamSearch
from mm_serve.frontend.processor import ProcessedPrompt
from mm_serve.messages.outputs import Logprob
from tests.fixtures.leaks import assert_llm_idle
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

PROMPT_LENGTHS = [3, 17, 40, 9]
# (beam_width, length_penalty, max_tokens)
CASES = [
    (1, 1.0, 6),
    (2, 1.0, 8),
    (4, 1.0, 12),
    (3, 0.0, 10),
    (4, 2.0, 12),
    (4, -1.0, 10),
    (2, 2.0, 16),
]
SCORE_TOL = 1e-4


def random_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_beam_search(model, inputs: dict, width: int, max_tokens: int, length_penalty: float):
    """HF's ``num_beams`` search: each returned sequence's generated ids (cut after its first
    stop token: HF pads the shorter ones) and scores (None for one beam), best first."""
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            output_scores=True,
            return_dict_in_generate=True,
        )
    stops = set(model.generation_config.eos_token_id)
    sequences = []
    for row in out.sequences[:, inputs["input_ids"].shape[1] :].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
        sequences.append(row[:end])
    scores = getattr(out, "sequences_scores", None)  # None: one beam is HF's greedy search
    return sequences, None if scores is None else scores.tolist()


def text_inputs(prompt: list[int]) -> dict:
    return {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt))}


def assert_matches_hf(llm: LLM, hf_model, prompts: list[list[int]]) -> int:
    """Every case on every prompt equals HF's; returns how many sequences ended on a stop."""
    num_stopped = 0
    for width, length_penalty, max_tokens in CASES:
        params = BeamSearchParams(width, max_tokens, length_penalty=length_penalty)
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, output in zip(prompts, outputs, strict=True):
            ref_ids, ref_scores = hf_beam_search(
                hf_model, text_inputs(prompt), width, max_tokens, length_penalty
            )
            case = (width, length_penalty, max_tokens, len(prompt))
            assert [s.output_token_ids for s in output.sequences] == ref_ids, case
            scores = [s.score for s in output.sequences]
            if ref_scores is not None:
                assert scores == pytest.approx(ref_scores, rel=1e-5, abs=SCORE_TOL), case
            assert all(s.tokens[: len(prompt)] == prompt for s in output.sequences)
            num_stopped += sum(s.finish_reason == "stop" for s in output.sequences)
    assert_llm_idle(llm)
    return num_stopped


def with_more_stop_tokens(path: str, folder: Path, stop_tokens: list[int]) -> str:
    """A copy of the checkpoint at ``path`` whose generation config adds ``stop_tokens`` to
    its end-of-sequence ids (which both HF and the engine stop at)."""
    copy = shutil.copytree(path, folder / "more_stops")
    config_path = Path(copy) / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = list(config["eos_token_id"]) + stop_tokens
    config_path.write_text(json.dumps(config))
    return str(copy)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_beam_search_matches_hf(model_path, tmp_path):
    llm = LLM(model_path)
    prompts = random_prompts(llm.config.model.vocab_size)
    assert_matches_hf(llm, hf_model(model_path), prompts)
    # The two most frequent generated tokens become stop tokens in a copy.
    outputs = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts], BeamSearchParams(4, max_tokens=12)
    )
    counts = collections.Counter(
        t for o in outputs for s in o.sequences for t in s.output_token_ids
    )
    llm.shutdown()
    stop_tokens = [token for token, _ in counts.most_common(2)]
    path = with_more_stop_tokens(model_path, tmp_path, stop_tokens)
    llm = LLM(path)
    assert assert_matches_hf(llm, hf_model(path), prompts) > 10  # stops were exercised
    llm.shutdown()


def test_ignore_eos(model_path, tmp_path):
    """With ``ignore_eos`` no stop token ends a beam: every sequence is ``max_tokens`` long,
    scored at that length, and the search is HF's on the checkpoint without extra stops."""
    llm = LLM(model_path)
    prompts = random_prompts(llm.config.model.vocab_size)[:2]
    llm.shutdown()
    model = hf_model(model_path)
    refs = [hf_beam_search(model, text_inputs(p), 3, 8, 1.0)[0] for p in prompts]
    assert all(len(sequence) == 8 for ref in refs for sequence in ref)  # no stop in them
    stop_tokens = sorted({t for ref in refs for sequence in ref for t in sequence[:3]})
    path = with_more_stop_tokens(model_path, tmp_path, stop_tokens)
    llm = LLM(path)
    params = BeamSearchParams(3, max_tokens=8, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for output, ref in zip(outputs, refs, strict=True):
        assert [s.output_token_ids for s in output.sequences] == ref
        for sequence in output.sequences:
            assert sequence.finish_reason == "length" and sequence.stop_reason is None
            assert sequence.score == pytest.approx(sequence.cum_logprob / 8)
    default = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(3, 8))
    assert any(s.finish_reason == "stop" for o in default for s in o.sequences)
    llm.shutdown()


def test_beams_share_prefix_blocks(llama_path):
    """Each round's requests find their prefix (the prompt and the beam's earlier tokens) in
    the prefix cache: beyond the first, a request computes at most one block's tokens. Without
    the prefix cache the result is the same."""
    block_size, width, max_tokens = 16, 4, 10
    prompt = random_prompts(400)[2]  # 40 tokens
    params = BeamSearchParams(width, max_tokens)
    llm = LLM(llama_path, block_size=block_size)
    (output,) = llm.beam_search({"prompt_token_ids": prompt}, params)
    stats = llm.get_stats()
    computed = stats.prefix_cache_queries - stats.prefix_cache_hits
    max_requests = 1 + width * (max_tokens - 1)
    assert stats.prefix_cache_hits > stats.prefix_cache_queries / 2
    assert computed <= len(prompt) + (max_requests - 1) * block_size
    assert_llm_idle(llm)
    llm.shutdown()
    unshared = LLM(llama_path, block_size=block_size, enable_prefix_caching=False)
    (alone,) = unshared.beam_search({"prompt_token_ids": prompt}, params)
    assert [s.tokens for s in alone.sequences] == [s.tokens for s in output.sequences]
    assert unshared.get_stats().prefix_cache_hits == 0
    unshared.shutdown()


def test_image_prompts_match_hf(tmp_path):
    """Image prompts: HF's sequences, and each image encoded once for all beams and rounds
    (the prefix cache holds its placeholder range)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = build_tiny_vlm_checkpoint(tmp_path, family="qwen2_vl", seed=3)
    tag = "<|vision_start|><|image_pad|><|vision_end|>"
    rng = np.random.default_rng(0)
    cases = [
        (f"{tag}Describe the image.", Image.fromarray(rng.integers(0, 256, (48, 64, 3), "u1"))),
        (f"Before {tag} after.", Image.fromarray(rng.integers(0, 256, (90, 40, 3), "u1"))),
    ]
    llm = LLM(path)
    prompts = [{"prompt": text, "multi_modal_data": {"image": [image]}} for text, image in cases]
    outputs = llm.beam_search(prompts, BeamSearchParams(3, max_tokens=8))
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    image_tokens = 0
    for (text, image), output in zip(cases, outputs, strict=True):
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        ref_ids, _ = hf_beam_search(model, dict(inputs), 3, 8, 1.0)
        assert [s.output_token_ids for s in output.sequences] == ref_ids
        prompt_ids = output.sequences[0].tokens[: output.sequences[0].num_prompt_tokens]
        assert prompt_ids == inputs["input_ids"][0].tolist()
        image_tokens += prompt_ids.count(llm.config.model.image_token_id)
    assert llm.get_stats().encoder_tokens_computed == image_tokens
    assert_llm_idle(llm)
    llm.shutdown()


# ---- one round, on made-up logprobs ----------------------------------------------------------


def made_up_search(width: int, stop_tokens: list[int], max_tokens: int = 10) -> BeamSearch:
    config = SimpleNamespace(max_model_len=100, vocab_size=50)  # all BeamSearch reads
    params = BeamSearchParams(width, max_tokens)
    return BeamSearch(ProcessedPrompt(None, [1, 2, 3]), params, stop_tokens, config)


def step(*pairs: tuple[int, float]) -> dict[int, Logprob]:
    return {token: Logprob(value) for token, value in pairs}


def test_a_round_keeps_hf_candidates():
    """A stop token among the best ``beam_width`` candidates finishes a sequence (scored with
    its own length); one ranked lower is dropped; the others fill the live beams in order."""
    search = made_up_search(2, stop_tokens=[9])
    assert search.num_candidates == 4  # max(2, 1 + one stop token) * 2
    search.advance([step((9, -0.1), (5, -0.5), (6, -0.7), (7, -2.0))])
    assert [(b.tokens, b.finish_reason, b.score) for b in search.finished] == [
        ([9], "stop", pytest.approx(-0.1))
    ]
    assert [b.tokens for b in search.running] == [[5], [6]]
    search.advance([step((9, -3.0), (8, -0.2)), step((4, -0.1), (9, -0.3))])
    # Candidates: [5,8] -0.7, [6,4] -0.8, [6,9] -1.0 (rank 2: dropped), [5,9] -3.5.
    assert [b.tokens for b in search.running] == [[5, 8], [6, 4]]
    assert [b.tokens for b in search.finished] == [[9]]


def test_search_stops_when_no_beam_can_win():
    """HF's heuristic: once ``beam_width`` sequences finished and the best live beam, scored
    at its current length, does not beat the worst of them, the search ends."""
    search = made_up_search(1, stop_tokens=[9])
    search.advance([step((9, -0.1), (5, -0.2))])
    assert search.done and [b.tokens for b in search.finished] == [[9]]
    search = made_up_search(1, stop_tokens=[9])
    search.advance([step((5, -0.1), (9, -0.2))])
    assert not search.done  # nothing finished: [9] ranked below the beam width
    search.advance([step((9, -0.05), (4, -1.0))])
    assert search.done and search.finished[0].score == pytest.approx(-0.15 / 2)


def test_last_round_finishes_the_best_beams():
    search = made_up_search(2, stop_tokens=[9], max_tokens=1)
    search.advance([step((3, -0.1), (9, -0.2), (4, -0.3))])
    assert search.done
    assert [(b.tokens, b.finish_reason) for b in search.finished] == [
        ([3], "length"),
        ([9], "stop"),
    ]
