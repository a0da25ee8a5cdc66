"""Sampling parameters of one request, in the shape of vLLM's / the OpenAI API's."""

from __future__ import annotations

from dataclasses import dataclass, field

from mm_serve.messages.structured_outputs import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to sample the output of one prompt.

    Logits are processed in this order (vLLM's): repetition, frequency and presence penalties;
    ``logit_bias`` added; stop tokens masked until ``min_tokens``; the structured-output
    grammar's mask (``structured_outputs``); temperature; min-p; top-k; top-p. ``temperature ==
    0`` is greedy (argmax after penalties). ``logprobs`` / ``prompt_logprobs`` report the raw
    model log-probabilities (log-softmax of the logits before any of these steps).

    Raises:
        ValueError: on any out-of-range value, with the field named.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n must be at least 1"),
            (self.temperature >= 0.0, "temperature must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be -1 (disabled), 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be positive"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be non-negative"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens must not exceed max_tokens",
            ),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be non-negative"),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "prompt_logprobs must be non-negative",
            ),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (
                all(-100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()),
                "logit_bias values must be in [-100, 100]",
            ),
            (
                self.seed is None or -(2**63) <= self.seed < 2**63,
                "seed must be a signed 64-bit integer",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Invalid sampling parameter: {message}.")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class BeamSearchParams:
    """Beam search over one prompt (``LLM.beam_search``; vLLM's ``BeamSearchParams``).

    ``beam_width`` beams are kept, and as many sequences returned, best first. A finished
    sequence scores ``cumulative_logprob / num_generated_tokens ** length_penalty`` (HF's
    score: an end-of-sequence token counts); a ``length_penalty`` above 0 favours longer
    sequences. ``ignore_eos``: end-of-sequence tokens end no beam. ``temperature`` is accepted
    as vLLM does; the candidates are ranked by the raw model logprobs, so it does not change
    the result (nor does it in vLLM V1, whose logprobs are raw too).

    Raises:
        ValueError: on an out-of-range value, with the field named.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        checks = [
            (self.beam_width >= 1, "beam_width must be at least 1"),
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0.0, "temperature must be non-negative"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Invalid beam search parameter: {message}.")
