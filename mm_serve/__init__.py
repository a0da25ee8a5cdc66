"""mm_serve: a serving engine for vision-language models."""

from mm_serve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Lazy: importing the package for SamplingParams must not load torch models.
    if name == "LLM":
        from mm_serve.engine.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from mm_serve import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
