"""Beam search over HTTP (vLLM's ``use_beam_search`` with ``n`` beams and ``length_penalty``)
against a real ``mm-serve serve`` subprocess (a tiny Qwen2-VL), with the offline
``LLM.beam_search`` on the same checkpoint as the reference: ``n`` choices, best first; a
stream sends the final result; fields beam search cannot honour are a 400 naming them."""

from __future__ import annotations

import openai
import pytest

from mm_serve import LLM, BeamSearchParams
from tests.fixtures.server import VLM_MAX_MODEL_LEN as MAX_MODEL_LEN
from tests.fixtures.server import VLM_SERVED_NAME as MODEL
from tests.fixtures.server import image_question, noise_png_url

BEAM = {"use_beam_search": True, "return_token_ids": True}


MESSAGES = image_question(noise_png_url(1, 60, 80))


@pytest.fixture(scope="module")
def client(vlm_openai):
    """The session's shared server (conftest's ``vlm_server``)."""
    return vlm_openai


def reference(vlm_llm: LLM, prompt, width: int, max_tokens: int, length_penalty: float = 1.0):
    params = BeamSearchParams(width, max_tokens, length_penalty=length_penalty)
    (output,) = vlm_llm.beam_search(prompt, params)
    scores = [s.score for s in output.sequences]
    assert scores == sorted(scores, reverse=True)
    return output.sequences


def test_chat_beam_search_as_offline_llm(client, vlm_llm):
    """``n`` choices, best first, as ``LLM.beam_search`` finds them for the rendered chat (the
    image included); their logprobs add up to each sequence's cumulative logprob; a stream
    gives the same choices."""
    sequences = reference(vlm_llm, vlm_llm.input_processor.apply_chat_template(MESSAGES), 3, 8, 0.5)
    body = dict(model=MODEL, messages=MESSAGES, n=3, max_tokens=8, logprobs=True, top_logprobs=2)
    extra = BEAM | {"length_penalty": 0.5}
    reply = client.chat.completions.create(**body, extra_body=extra)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice, sequence in zip(reply.choices, sequences, strict=True):
        assert choice.token_ids == sequence.output_token_ids
        assert choice.message.content == sequence.text
        assert choice.finish_reason == sequence.finish_reason
        logprobs = [entry.logprob for entry in choice.logprobs.content]
        assert sum(logprobs) == pytest.approx(sequence.cum_logprob, abs=1e-4)
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert reply.usage.completion_tokens == sum(len(s.output_token_ids) for s in sequences)
    chunks = list(client.chat.completions.create(**body, stream=True, extra_body=extra))
    streamed: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).extend(choice.token_ids or ())
    assert streamed == {i: s.output_token_ids for i, s in enumerate(sequences)}


def test_completions_beam_search_as_offline_llm(client, vlm_llm):
    """A batch of prompts: choice ``i * n + j`` is prompt ``i``'s ``j``-th best sequence."""
    prompts = ["The harbor town woke", "A neural network is"]
    body = dict(model=MODEL, prompt=prompts, n=2, max_tokens=6, logprobs=1)
    reply = client.completions.create(**body, extra_body=BEAM)
    assert len(reply.choices) == 4
    for i, prompt in enumerate(prompts):
        for j, sequence in enumerate(reference(vlm_llm, prompt, 2, 6)):
            choice = reply.choices[i * 2 + j]
            assert choice.index == i * 2 + j
            assert (choice.text, choice.token_ids) == (sequence.text, sequence.output_token_ids)
            logprobs = choice.logprobs.token_logprobs
            assert sum(logprobs) == pytest.approx(sequence.cum_logprob, abs=1e-4)
    plain = client.completions.create(
        model=MODEL,
        prompt=prompts[0],
        max_tokens=6,
        temperature=0,
        extra_body={"length_penalty": 2},
    )
    assert len(plain.choices) == 1  # without use_beam_search, length_penalty changes nothing


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": ["."]}, "stop"),
        ({"stop_token_ids": [3]}, "stop_token_ids"),
        ({"top_k": 5}, "top_k"),
        ({"top_p": 0.5}, "top_p"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"n": 0}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_tokens": 10 * MAX_MODEL_LEN}, "max_tokens"),
        ({"length_penalty": "long"}, "length_penalty"),
    ],
)
def test_beam_search_bad_requests(client, extra, param):
    """What beam search cannot honour (or a value it cannot take) is a 400 naming the field,
    on both endpoints."""
    with pytest.raises(openai.BadRequestError, match=param) as error:
        client.completions.create(model=MODEL, prompt="Hello", extra_body=BEAM | extra)
    body = error.value.body
    body = body.get("error", body) if isinstance(body, dict) else {}
    # SamplingParams' own checks name the field in the message only.
    assert body.get("param") in ((param, None) if param in ("n", "temperature") else (param,))
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match=param):
        client.chat.completions.create(model=MODEL, messages=messages, extra_body=BEAM | extra)


def test_neutral_sampling_values_are_accepted(client):
    """The values of those fields that change nothing are no conflict."""
    neutral = {"stop": [], "top_k": -1, "top_p": 1.0, "repetition_penalty": 1.0, "min_p": 0}
    extra = BEAM | neutral | {"n": 2, "max_tokens": 3}
    reply = client.completions.create(model=MODEL, prompt="Hello", extra_body=extra)
    assert len(reply.choices) == 2
