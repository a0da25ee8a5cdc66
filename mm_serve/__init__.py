"""mm_serve: a serving engine for vision-language models."""

from mm_serve.utils._compat import ensure_torchvision_importable_on_import

# Before anything imports torchvision (transformers' image processors do): see _compat.
ensure_torchvision_importable_on_import()

from mm_serve.lora.request import LoRARequest  # noqa: E402
from mm_serve.messages.pooling_params import PoolingParams  # noqa: E402
from mm_serve.messages.sampling_params import BeamSearchParams, SamplingParams  # noqa: E402

__all__ = [
    "LLM", "SamplingParams", "BeamSearchParams", "PoolingParams", "RequestOutput",
    "CompletionOutput", "EmbeddingRequestOutput", "LoRARequest",
]  # fmt: skip


def __getattr__(name: str):
    # Lazy: importing the package for SamplingParams must not load torch models.
    if name == "LLM":
        from mm_serve.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput", "EmbeddingRequestOutput"):
        from mm_serve.messages import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
