"""Logprobs in OpenAI's shapes (chat's ``logprobs.content``, completions' ``logprobs``) and
vLLM's ``prompt_logprobs``."""

from __future__ import annotations

from mm_serve.entrypoints.openai.protocol import (
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobList,
    TokenLogprob,
    TopLogprob,
)
from mm_serve.messages.outputs import Logprob, PromptLogprobs, SampleLogprobs


def _token_text(token_id: int, logprob: Logprob, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else logprob.decoded_token or ""


def _top(step: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The ``num`` most likely tokens of one step, most likely first."""
    ranked = [(t, lp) for t, lp in step.items() if lp.rank is not None and lp.rank <= num]
    return sorted(ranked, key=lambda item: item[1].rank)


def chat_logprobs(
    token_ids: list[int], logprobs: SampleLogprobs, num_top: int, as_ids: bool
) -> list[TokenLogprob]:
    """OpenAI chat ``logprobs.content``: one entry per token, with its ``num_top`` best."""
    entries = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        chosen = step[token_id]
        text = _token_text(token_id, chosen, as_ids)
        top = [
            TopLogprob(token=(t := _token_text(i, lp, as_ids)), logprob=lp.logprob, bytes=_b(t))
            for i, lp in _top(step, num_top)
        ]
        entries.append(
            TokenLogprob(token=text, logprob=chosen.logprob, bytes=_b(text), top_logprobs=top)
        )
    return entries


def _b(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def completion_logprobs(
    token_ids: list[int],
    logprobs: SampleLogprobs,
    num_top: int,
    as_ids: bool,
    offset: int,
    into: CompletionLogprobs | None = None,
) -> tuple[CompletionLogprobs, int]:
    """OpenAI completions ``logprobs`` (appended to ``into`` when given), and the text offset
    after the last token; ``offset``: the text offset of the first token (in characters). Each
    ``top_logprobs`` entry holds the ``num_top`` most likely tokens and the sampled one (vLLM's
    reading)."""
    result = CompletionLogprobs() if into is None else into
    for token_id, step in zip(token_ids, logprobs, strict=True):
        chosen = step[token_id]
        text = _token_text(token_id, chosen, as_ids)
        result.tokens.append(text)
        result.token_logprobs.append(chosen.logprob)
        result.text_offset.append(offset)
        top = {_token_text(i, lp, as_ids): lp.logprob for i, lp in _top(step, num_top)}
        top.setdefault(text, chosen.logprob)  # the sampled token too, as vLLM (logprobs=0: alone)
        result.top_logprobs.append(top)
        offset += len(chosen.decoded_token or "")
    return result, offset


def echo_logprobs(
    token_ids: list[int], logprobs: PromptLogprobs, text: str, num_top: int, as_ids: bool
) -> tuple[CompletionLogprobs, int]:
    """The prompt's part of an echoed completion's ``logprobs`` (vLLM's): the first token has
    neither logprob nor top logprobs (None), the others are as a completion's; its text is
    what the others' do not cover of the prompt's ``text``. Returns them and the text offset
    after the prompt."""
    steps = zip(token_ids[1:], logprobs[1:], strict=True)
    rest = "".join(step[token_id].decoded_token or "" for token_id, step in steps)
    first = text[: max(len(text) - len(rest), 0)]
    token = f"token_id:{token_ids[0]}" if as_ids else first
    result = CompletionLogprobs(
        text_offset=[0], token_logprobs=[None], tokens=[token], top_logprobs=[None]
    )
    return completion_logprobs(token_ids[1:], logprobs[1:], num_top, as_ids, len(first), result)


def prompt_logprobs_field(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobList | None:
    """vLLM's ``prompt_logprobs`` response field from the engine's (None when not asked)."""
    if prompt_logprobs is None:
        return None

    def entry(lp: Logprob) -> PromptLogprob:
        return PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)

    return [
        None if step is None else {token_id: entry(lp) for token_id, lp in step.items()}
        for step in prompt_logprobs
    ]
