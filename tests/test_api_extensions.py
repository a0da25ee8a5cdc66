"""vLLM's response extensions over HTTP (``return_token_ids``, ``prompt_logprobs``), completions
``echo`` and ``logprobs=0``, against a real ``mm-serve serve`` subprocess (a tiny Qwen2-VL)
with the offline ``LLM`` on the same checkpoint as the reference."""

from __future__ import annotations

import openai
import pytest

from mm_serve import SamplingParams
from tests.fixtures.server import VLM_SERVED_NAME as MODEL
from tests.fixtures.server import image_question, noise_png_url

MAX_TOKENS = 10


MESSAGES = image_question(noise_png_url(0, 90, 120))


@pytest.fixture(scope="module")
def client(vlm_openai):
    """The session's shared server (conftest's ``vlm_server``)."""
    return vlm_openai


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, **kwargs)


def test_return_token_ids_as_offline_llm(client, vlm_llm):
    """vLLM's return_token_ids: the prompt's ids (image placeholders expanded) once, and each
    choice's generated ids, in a response and across a stream's chunks."""
    messages = MESSAGES
    (ref,) = vlm_llm.chat(messages, greedy(), use_tqdm=False)
    body = dict(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    extra = {"return_token_ids": True}
    reply = client.chat.completions.create(**body, extra_body=extra)
    assert reply.prompt_token_ids == ref.prompt_token_ids
    assert reply.choices[0].token_ids == ref.outputs[0].token_ids
    chunks = list(client.chat.completions.create(**body, stream=True, extra_body=extra))
    assert [c.prompt_token_ids for c in chunks if c.prompt_token_ids] == [ref.prompt_token_ids]
    streamed = [t for c in chunks for choice in c.choices for t in choice.token_ids or ()]
    assert streamed == ref.outputs[0].token_ids
    plain = client.chat.completions.create(**body)
    assert plain.prompt_token_ids is None and plain.choices[0].token_ids is None

    prompt = "The capital of France is"
    (ref,) = vlm_llm.generate([prompt], greedy(), use_tqdm=False)
    body = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    (choice,) = client.completions.create(**body, extra_body=extra).choices
    assert (choice.prompt_token_ids, choice.token_ids) == (
        ref.prompt_token_ids,
        ref.outputs[0].token_ids,
    )
    chunks = list(client.completions.create(**body, stream=True, extra_body=extra))
    assert [c.choices[0].prompt_token_ids for c in chunks][0] == ref.prompt_token_ids
    assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == ref.outputs[0].token_ids


def test_prompt_logprobs_as_offline_llm(client, vlm_llm):
    """vLLM's prompt_logprobs: None for the first prompt token, then each token's logprob with
    the top 2, equal to the offline LLM's; on chat (images expanded) and completions."""

    def same(got: list, expected: list) -> None:
        assert len(got) == len(expected) and got[0] is None and expected[0] is None
        for step, ref_step in zip(got[1:], expected[1:], strict=True):
            assert {int(t) for t in step} == set(ref_step)
            for token_id, entry in step.items():
                ref = ref_step[int(token_id)]
                assert entry["logprob"] == pytest.approx(ref.logprob, abs=1e-4)
                assert entry["rank"] == ref.rank

    params = greedy(prompt_logprobs=2)
    prompt = "The capital of France is"
    (ref,) = vlm_llm.generate([prompt], params, use_tqdm=False)
    body = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    (choice,) = client.completions.create(**body, extra_body={"prompt_logprobs": 2}).choices
    same(choice.prompt_logprobs, ref.prompt_logprobs)
    messages = MESSAGES
    (ref,) = vlm_llm.chat(messages, params, use_tqdm=False)
    body = dict(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    reply = client.chat.completions.create(**body, extra_body={"prompt_logprobs": 2})
    same(reply.prompt_logprobs, ref.prompt_logprobs)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(**body, stream=True, extra_body={"prompt_logprobs": 2})


def test_completion_echo(client, vlm_llm, vlm_path):
    """echo: each choice's text starts with its prompt (token-id prompts decoded), in a
    response and in a stream's first chunk; not with logprobs (a 400 naming echo)."""
    from transformers import AutoTokenizer

    prompt = "The capital of France is"
    (ref,) = vlm_llm.generate([prompt], greedy(), use_tqdm=False)
    body = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, echo=True)
    assert client.completions.create(**body).choices[0].text == prompt + ref.outputs[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
    assert streamed == prompt + ref.outputs[0].text
    tokenizer = AutoTokenizer.from_pretrained(vlm_path)
    ids = tokenizer("def fibonacci(n):").input_ids
    reply = client.completions.create(**{**body, "prompt": ids})
    assert reply.choices[0].text.startswith(tokenizer.decode(ids))
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(**body, logprobs=1, stream=True)


def test_completion_echo_with_logprobs(client, vlm_llm):
    """echo with logprobs (vLLM's): the prompt's tokens lead the choice's logprobs, the first
    with none, the others with the prompt logprobs of the offline engine; text offsets run
    over the echoed text."""
    prompt = "The capital of France is"
    (ref,) = vlm_llm.generate([prompt], greedy(prompt_logprobs=2), use_tqdm=False)
    body = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, echo=True)
    (choice,) = client.completions.create(**body, logprobs=2).choices
    logprobs, num_prompt = choice.logprobs, len(ref.prompt_token_ids)
    assert choice.text == prompt + ref.outputs[0].text and choice.prompt_logprobs is None
    assert len(logprobs.tokens) == num_prompt + len(ref.outputs[0].token_ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position, step in enumerate(ref.prompt_logprobs[1:], start=1):
        expected = step[ref.prompt_token_ids[position]]
        assert logprobs.token_logprobs[position] == pytest.approx(expected.logprob, abs=1e-4)
        assert logprobs.tokens[position] == expected.decoded_token
    assert "".join(logprobs.tokens[:num_prompt]) == prompt
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[num_prompt] == len(prompt)


def test_completion_logprobs_zero_gives_the_sampled_token(client):
    """logprobs=0: each top_logprobs entry is the sampled token alone (vLLM's reading); with
    logprobs=2 under greedy sampling the sampled token is the best of the two."""
    for num in (0, 2):
        reply = client.completions.create(
            model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4,
            logprobs=num,
        )  # fmt: skip
        logprobs = reply.choices[0].logprobs
        assert len(logprobs.tokens) == 4
        for token, logprob, top in zip(
            logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
        ):
            assert top[token] == logprob and len(top) == max(num, 1)
            assert logprob == max(top.values())
