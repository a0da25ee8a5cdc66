"""Beam search as a front-end algorithm over the engine (the engine knows nothing of beams), as
vLLM V1's ``vllm/beam_search.py``; candidates, finishing and scores as HF
``GenerationMixin._beam_search`` (transformers 5), so results equal HF's
``generate(num_beams=..., do_sample=False)``.

A ``BeamSearch`` holds one prompt's search. Each round the driver (``LLM.beam_search``,
``AsyncLLM.beam_search``) submits one request per live beam (prompt + beam tokens,
``max_tokens=1``, top ``K = max(2, 1 + number of stop tokens) * beam_width`` raw logprobs);
the beams share their common prefix's KV blocks through the prefix cache.

``BeamSearch.advance``: each candidate (beam, one of its top ``K`` tokens) scores the beam's
cumulative logprob plus the token's; of the best ``K``, those ending in a stop token (or at
``max_tokens``) among the first ``beam_width`` finish, scored
``cumulative_logprob / num_generated_tokens ** length_penalty``, best ``beam_width`` kept; the
best ``beam_width`` others are the next beams. The search ends when no beam is left, or (HF's
``early_stopping=False``) when ``beam_width`` finished and the best live beam does not beat the
worst of them."""

from __future__ import annotations

from dataclasses import dataclass, field

from mm_serve.config import ModelConfig
from mm_serve.frontend.processor import ProcessedPrompt
from mm_serve.messages.outputs import CompletionOutput, Logprob, RequestOutput
from mm_serve.messages.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One sequence found by beam search (vLLM's fields).

    ``tokens``: the prompt's token ids (images expanded) followed by the generated ones, a
    stop token included; ``text``: the generated tokens decoded (special tokens skipped);
    ``logprobs``: one dict per generated token (its top ``K`` candidates and the token);
    ``score``: ``cum_logprob`` with the length penalty, what the sequences are ranked by.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    score: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (a stop token) or "length" (max_tokens)
    stop_reason: int | None = None  # the stop token that ended it
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids (``tokens`` past the prompt)."""
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best (highest score) first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None
    score: float = 0.0


def beam_score(cum_logprob: float, num_generated: int, length_penalty: float) -> float:
    """HF's score of a finished sequence: its cumulative logprob over its length (generated
    tokens, a stop token included) to the power ``length_penalty``."""
    return cum_logprob / (num_generated**length_penalty)


class BeamSearch:
    """The beam search of one processed prompt: ``requests()`` gives this round's engine
    prompts, ``advance()`` takes their logprobs, until ``done``; then ``output()``.

    Args:
        prompt: the processed prompt (images expanded, features kept for every round).
        params: the search's parameters.
        stop_token_ids: the tokens that end a sequence (the tokenizer's end-of-sequence token
            and those of ``generation_config.json``); ``params.ignore_eos`` disables them.
        model_config: the model's: the search ends where prompt and tokens fill its context,
            and asks for no more logprobs than its vocabulary has.
    """

    def __init__(
        self,
        prompt: ProcessedPrompt,
        params: BeamSearchParams,
        stop_token_ids: list[int],
        model_config: ModelConfig,
    ) -> None:
        self.prompt = prompt
        self.params = params
        self.stop_token_ids = set() if params.ignore_eos else set(stop_token_ids)
        room = model_config.max_model_len - len(prompt.token_ids)
        self.max_tokens = min(params.max_tokens, room)
        num_candidates = max(2, 1 + len(set(stop_token_ids))) * params.beam_width
        self.vocab_size = model_config.vocab_size
        self.num_candidates = min(num_candidates, self.vocab_size)
        self.running: list[_Beam] = [_Beam()]
        self.finished: list[_Beam] = []  # the best beam_width, best first

    @property
    def done(self) -> bool:
        """True once no round is left to run."""
        return not self.running

    def sampling_params(self, num_logprobs: int = 0) -> SamplingParams:
        """One round's engine request: one greedy token with the top ``K`` logprobs (more
        when ``num_logprobs`` asks for more, for a response's top logprobs)."""
        num = min(max(self.num_candidates, num_logprobs), self.vocab_size)
        return SamplingParams(temperature=0.0, max_tokens=1, logprobs=num, ignore_eos=True)

    def requests(self) -> list[ProcessedPrompt]:
        """This round's engine prompts, one per live beam: the prompt and the beam's tokens
        (same images, same cache salt: the prefix cache shares their KV blocks)."""
        prompt = self.prompt
        return [
            ProcessedPrompt(
                None, prompt.token_ids + beam.tokens, prompt.mm_features, prompt.cache_salt
            )
            for beam in self.running
        ]

    def advance(self, logprobs: list[dict[int, Logprob]]) -> None:
        """One round: ``logprobs[i]`` is live beam ``i``'s next-token logprobs (its top ``K``).

        Raises:
            ValueError: not one dict per live beam.
        """
        if len(logprobs) != len(self.running):
            raise ValueError(f"Got {len(logprobs)} logprobs for {len(self.running)} beams.")
        width = self.params.beam_width
        last_round = len(self.running[0].tokens) + 1 >= self.max_tokens
        candidates = [
            (beam.cum_logprob + logprob.logprob, beam, token_id, step)
            for beam, step in zip(self.running, logprobs, strict=True)
            for token_id, logprob in step.items()
        ]
        candidates.sort(key=lambda candidate: candidate[0], reverse=True)
        running: list[_Beam] = []
        for rank, (cum_logprob, beam, token_id, step) in enumerate(
            candidates[: self.num_candidates]
        ):
            stops = token_id in self.stop_token_ids
            if (stops or last_round) and rank < width:
                new = _Beam(beam.tokens + [token_id], beam.logprobs + [step], cum_logprob)
                new.finish_reason, new.stop_reason = (
                    ("stop", token_id) if stops else ("length", None)
                )
                new.score = beam_score(cum_logprob, len(new.tokens), self.params.length_penalty)
                self.finished.append(new)
            elif not (stops or last_round) and len(running) < width:
                running.append(_Beam(beam.tokens + [token_id], beam.logprobs + [step], cum_logprob))
        self.finished = sorted(self.finished, key=lambda b: b.score, reverse=True)[:width]
        self.running = [] if self._cannot_improve(running) else running

    def _cannot_improve(self, running: list[_Beam]) -> bool:
        """HF's ``early_stopping=False`` heuristic: ``beam_width`` sequences finished, and
        the best live beam scored at its current length does not beat the worst of them."""
        if not running or len(self.finished) < self.params.beam_width:
            return False
        best = max(beam.cum_logprob for beam in running)
        length = len(running[0].tokens)
        return beam_score(best, length, self.params.length_penalty) <= self.finished[-1].score

    def output(self, tokenizer) -> BeamSearchOutput:
        """The best ``beam_width`` sequences, best first, their text decoded."""
        prompt_ids = self.prompt.token_ids
        sequences = [
            BeamSearchSequence(
                tokens=prompt_ids + beam.tokens,
                logprobs=beam.logprobs,
                cum_logprob=beam.cum_logprob,
                score=beam.score,
                text=tokenizer.decode(beam.tokens, skip_special_tokens=True),
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
                num_prompt_tokens=len(prompt_ids),
            )
            for beam in self.finished
        ]
        return BeamSearchOutput(sequences)


def to_request_output(request_id: str, prompt: ProcessedPrompt, output: BeamSearchOutput):
    """The search's result as a finished ``RequestOutput``: completion ``i`` is the ``i``-th
    best sequence (what the OpenAI server answers)."""
    completions = [
        CompletionOutput(
            index=i,
            text=sequence.text or "",
            token_ids=sequence.output_token_ids,
            cumulative_logprob=sequence.cum_logprob,
            logprobs=sequence.logprobs,
            finish_reason=sequence.finish_reason,
            stop_reason=sequence.stop_reason,
        )
        for i, sequence in enumerate(output.sequences)
    ]
    return RequestOutput(
        request_id=request_id,
        prompt=prompt.text,
        prompt_token_ids=prompt.token_ids,
        prompt_logprobs=None,
        outputs=completions,
        finished=True,
    )
