"""What the model-family tests check alike, against HF transformers on the same folder.

Inputs come from ``mm_serve.testing.images`` (photographs, odd sizes, the mixed batch). The
fixtures: a family's tiny checkpoint and ``HFReference`` on it (``checkpoint_fixtures``): HF's
processor and model, float32 and eager attention, with greedy ``generate`` and each step's
log-probs (``hf_reference.hf_greedy_generate``). The checks: our processor's placeholder
expansion equals HF's (``assert_expansion_matches_hf``); the engine's prompt ids, greedy tokens
and top-5 log-probs equal HF's and no KV block or encoder-cache entry is left held after
(``assert_greedy_matches_hf``; ``assert_matches_hf`` for image prompts), the same for a chat
turn (``assert_chat_matches_hf``) and for a repeated image through the prefix cache
(``assert_prefix_cache_hits``); ``record_encoded_images`` shows what the tower encoded, and
``meta_parameter_counts`` compares a published size with HF's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.testing.hf_reference import hf_greedy_generate
from mm_serve.testing.images import Case
from mm_serve.testing.leaks import assert_llm_idle
from mm_serve.testing.vlm_checkpoints import build_tiny_vlm_checkpoint

MAX_NEW_TOKENS = 12
LOGPROB_TOL = 1e-4  # float32: our top-5 log-probs within this of HF's log-softmax
TOP_LOGPROBS = 5
# HF's greedy run: (prompt ids, generated ids, per-step log-softmax ``[steps, vocab]``).
HFGreedy = tuple[list[int], list[int], torch.Tensor]
C = TypeVar("C")


def whole_and_chunked(budget: int = 8) -> Any:
    """pytest's parametrization of ``engine_args``: the default engine ("whole") and a step
    budget of ``budget`` tokens with 4-token blocks ("chunked": prompts and images cut across
    steps)."""
    import pytest

    chunked = {"max_num_batched_tokens": budget, "block_size": 4}
    return pytest.mark.parametrize("engine_args", [{}, chunked], ids=["whole", "chunked"])


def hf_config(path: str | Path) -> Any:
    """transformers' ``AutoConfig`` of the folder ``path``."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def image_processor(path: str | Path) -> Any:
    """Our image processor of the folder ``path`` (``processors.get_image_processor`` on its
    config)."""
    from mm_serve.encoders.processors import get_image_processor

    return get_image_processor(str(path), hf_config(path))


def assert_expansion_matches_hf(
    processor: Any, text: str, item: Any, hf_input_ids: torch.Tensor
) -> None:
    """The text's one image placeholder replaced by ``item``'s own token ids (our processor's
    expansion: tile tags, newlines, image tokens) gives HF's ``hf_input_ids`` ``[1, L]``
    (``processor``: HF's, on ``text`` and the same image); ``item.num_tokens`` counts them.

    Raises:
        AssertionError: on a difference.
    """
    ids = processor.tokenizer(text)["input_ids"]
    at = ids.index(processor.image_token_id)
    assert ids[:at] + list(item.token_ids) + ids[at + 1 :] == hf_input_ids[0].tolist()
    assert item.num_tokens == len(item.token_ids)


def meta_parameter_counts(config: Any, *model_classes: type) -> list[int]:
    """The number of parameters of each of ``model_classes`` built from ``config`` on the meta
    device (no memory taken: a published size is counted without its weights)."""
    with torch.device("meta"):
        return [sum(p.numel() for p in cls(config).parameters()) for cls in model_classes]


@contextmanager
def running_llm(path: str, **engine_args: Any) -> Iterator[LLM]:
    """``LLM(path, **engine_args)``, shut down on leaving (also when a check fails)."""
    llm = LLM(path, **engine_args)
    try:
        yield llm
    finally:
        llm.shutdown()


@dataclass(frozen=True)
class HFReference:
    """HF's processor and model on a checkpoint folder (float32, eager attention).

    ``nested_images``: the processor takes a prompt's images as a list per prompt (Idefics3,
    InternVL, LLaVA-OneVision), else as one flat list (the Qwen-VL processors).
    """

    processor: Any
    model: Any
    nested_images: bool = True

    @classmethod
    def load(cls, path: str, nested_images: bool = True) -> HFReference:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        return cls(AutoProcessor.from_pretrained(path), model.eval(), nested_images)

    def greedy(
        self,
        text: str,
        images: Sequence[Image.Image] = (),
        max_new_tokens: int = MAX_NEW_TOKENS,
        **processor_kwargs: Any,
    ) -> HFGreedy:
        """HF's greedy ``generate`` on ``inputs(text, images, **processor_kwargs)``."""
        inputs = self.inputs(text, images, **processor_kwargs)
        return hf_greedy_generate(self.model, inputs, max_new_tokens)

    def inputs(self, text: str, images: Sequence[Image.Image] = (), **processor_kwargs: Any) -> Any:
        """HF's processor on one prompt: ``text`` (its placeholders expanded) and ``images``;
        ``processor_kwargs`` (videos, their metadata, sampling options) go to the processor.
        Returns its ``BatchFeature`` of tensors (``input_ids`` ``[1, L]``, pixels...)."""
        batch = None
        if images:
            batch = [list(images)] if self.nested_images else list(images)
        return self.processor(text=[text], images=batch, return_tensors="pt", **processor_kwargs)


def checkpoint_fixtures(family: str, seed: int = 3, nested_images: bool = True) -> Any:
    """The module-scoped pytest fixtures ``path`` (the tiny ``family`` checkpoint of
    ``build_tiny_vlm_checkpoint``, seeded by ``seed``) and ``reference`` (``HFReference`` on
    it); a test module takes them with ``path, reference = checkpoint_fixtures(...)``."""
    import pytest

    @pytest.fixture(scope="module")
    def path(tmp_path_factory: Any) -> str:
        return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp(family), family, seed=seed)

    @pytest.fixture(scope="module")
    def reference(path: str) -> HFReference:
        return HFReference.load(path, nested_images)

    return path, reference


def image_prompt(case: Case) -> dict[str, Any]:
    """``LLM.generate``'s prompt of an image ``case``."""
    text, images = case
    return {"prompt": text, "multi_modal_data": {"image": images}}


def assert_greedy_matches_hf(
    llm: LLM,
    cases: Sequence[C],
    engine_prompt: Callable[[C], Any],
    hf_greedy: Callable[[C], HFGreedy],
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[Any]:
    """Run ``cases`` as one batch, greedy with ``TOP_LOGPROBS`` log-probs per step, and check
    each output against ``hf_greedy(case)``: the prompt ids (placeholders expanded as HF's
    processor does), the generated ids, and each step's log-probs (at least the top 5) within
    ``LOGPROB_TOL`` of HF's log-softmax; then that the engine holds nothing
    (``assert_llm_idle``). Returns the outputs, in the order of ``cases``.

    Raises:
        AssertionError: on the first difference or leak.
    """
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=TOP_LOGPROBS)
    outputs = llm.generate([engine_prompt(case) for case in cases], params, use_tqdm=False)
    for case, output in zip(cases, outputs, strict=True):
        prompt_ids, ref_tokens, ref_logprobs = hf_greedy(case)
        assert output.prompt_token_ids == prompt_ids  # expansion as HF's processor
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        assert len(completion.logprobs) == len(ref_tokens)
        for step, step_logprobs in enumerate(completion.logprobs):
            assert len(step_logprobs) >= TOP_LOGPROBS
            for token_id, logprob in step_logprobs.items():
                assert abs(logprob.logprob - ref_logprobs[step, token_id].item()) < LOGPROB_TOL
    assert_llm_idle(llm)
    return outputs


def assert_matches_hf(llm: LLM, reference: HFReference, cases: Sequence[Case]) -> list[Any]:
    """``assert_greedy_matches_hf`` for image ``cases`` against ``reference``."""
    return assert_greedy_matches_hf(llm, cases, image_prompt, lambda case: reference.greedy(*case))


def user_turn(images: Sequence[Image.Image], text: str = "What?") -> list[dict[str, Any]]:
    """Chat messages of one user turn: an image part per image, then ``text``."""
    parts = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def assert_chat_matches_hf(
    llm: LLM,
    messages: list[dict[str, Any]],
    processor: Any,
    hf_greedy: Callable[[str], HFGreedy],
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> Any:
    """``LLM.chat`` on ``messages``, greedy: its prompt ids and tokens equal
    ``hf_greedy(text)``'s, ``text`` being ``processor``'s chat template applied to
    ``messages``; nothing left held. Returns the output.

    Raises:
        AssertionError: on a difference or a leak.
    """
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    (output,) = llm.chat(messages, params, use_tqdm=False)
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids, ref_tokens, _ = hf_greedy(text)
    assert output.prompt_token_ids == prompt_ids
    assert output.outputs[0].token_ids == ref_tokens
    assert_llm_idle(llm)
    return output


def assert_image_chat_matches_hf(
    llm: LLM, reference: HFReference, images: list[Image.Image]
) -> Any:
    """``assert_chat_matches_hf`` for ``user_turn(images)``: the chat template's image
    placeholders expanded as HF's processor does, and HF's greedy tokens."""
    greedy = partial(reference.greedy, images=images)
    return assert_chat_matches_hf(llm, user_turn(images), reference.processor, greedy)


def assert_prefix_cache_hits(
    llm: LLM, reference: HFReference, case: Case, again: Case, other: Case
) -> None:
    """``case``, then ``again`` (the same text and image content), then ``other`` (the same
    text, another image), one request after the other on ``llm`` (prefix caching on, 4-token
    blocks): ``again`` reuses all of ``case``'s KV blocks but the last and generates the same;
    ``other`` hits less than 8 tokens (the image hash is in the block hashes). All match HF.

    Raises:
        AssertionError: on a difference, a hit missing or too long, or a leak.
    """
    (first,) = assert_matches_hf(llm, reference, [case])
    (second,) = assert_matches_hf(llm, reference, [again])
    assert second.num_cached_tokens >= len(second.prompt_token_ids) - 4
    (third,) = assert_matches_hf(llm, reference, [other])
    assert third.num_cached_tokens < 8
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def record_encoded_images(llm: LLM) -> list[Any]:
    """Wrap the in-process model's ``embed_images`` (an ``LLM`` with ``multiprocess=False``,
    which CUDA does not default to): the returned list collects every image item the tower
    encodes from then on, in order. Raises TypeError for an engine core in its own process."""
    runner = getattr(llm.engine_core, "model_runner", None)
    if runner is None:
        raise TypeError("record_encoded_images needs LLM(..., multiprocess=False).")
    model = runner.model
    encoded: list[Any] = []
    embed_images = model.embed_images

    def recording(images: list[Any]) -> Any:
        encoded.extend(images)
        return embed_images(images)

    model.embed_images = recording
    return encoded
