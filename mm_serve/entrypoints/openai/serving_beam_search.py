"""vLLM's ``use_beam_search`` over HTTP: which request fields it takes, and its parameters
(the search itself: ``mm_serve.frontend.beam_search``, run by ``AsyncLLM.beam_search``)."""

from __future__ import annotations

from mm_serve.entrypoints.openai.errors import bad_request, user_errors
from mm_serve.entrypoints.openai.protocol import SamplingRequest
from mm_serve.messages.sampling_params import BeamSearchParams, SamplingParams

# Fields beam search cannot honour, with the values that change nothing: another is a 400.
_NOT_WITH_BEAM_SEARCH = {
    "stop": (None, []), "stop_token_ids": (None, []), "min_tokens": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "top_p": (None, 1), "top_k": (None, 0, -1), "min_p": (None, 0), "prompt_logprobs": (None,),
    "logit_bias": (None, {}), "response_format": (None,), "structured_outputs": (None,),
}  # fmt: skip


def check_beam_search(request: SamplingRequest) -> None:
    """Raises APIError (400) naming a field set to a value beam search cannot honour (stop
    strings or tokens, penalties, truncated sampling, prompt logprobs, logit bias, a
    structured output)."""
    for name, neutral in _NOT_WITH_BEAM_SEARCH.items():
        if getattr(request, name) not in neutral:
            raise bad_request(f"{name} cannot be used with use_beam_search.", param=name)


def beam_search_params(request: SamplingRequest, params: SamplingParams) -> BeamSearchParams:
    """``n`` beams, ``max_tokens`` rounds, ``ignore_eos``, ``temperature`` and the request's
    ``length_penalty`` (vLLM's ``to_beam_search_params``).

    Raises:
        APIError: (400) a value out of range.
    """
    with user_errors():
        return BeamSearchParams(
            beam_width=params.n,
            max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos,
            temperature=params.temperature,
            length_penalty=request.length_penalty,
        )
