"""The config tree, resolved once at start-up in the front end: ``EngineArgs`` and the
frozen ``EngineConfig`` with its parts (``engine``), the compilation and CUDA-graph sizes
(``compilation``), tensor and data parallelism (``parallel``)."""

from mm_serve.config.compilation import CompilationConfig
from mm_serve.config.engine import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    CacheConfig,
    EngineArgs,
    EngineConfig,
    KernelConfig,
    ModelConfig,
    MultiModalConfig,
    SchedulerConfig,
    load_chat_template,
    resolve_device,
)
from mm_serve.config.parallel import ParallelConfig

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "CacheConfig",
    "CompilationConfig",
    "EngineArgs",
    "EngineConfig",
    "KernelConfig",
    "ModelConfig",
    "MultiModalConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "load_chat_template",
    "resolve_device",
]
