"""One typed config tree, resolved once at start-up, in the front end.

``EngineArgs`` holds the flat user-facing knobs (the ``LLM`` kwargs and the CLI flags);
``EngineArgs.create_engine_config()`` resolves them into an ``EngineConfig`` of frozen
dataclasses, which the engine core process receives as it is. Derived values (the number of KV
blocks, sized from the free device memory) are computed by their owner and passed down
explicitly; they are never written back into the config.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from mm_serve.checkpoint.families import find_family
from mm_serve.checkpoint.hub import (
    load_hf_config,
    resolve_dtype,
    resolve_max_model_len,
    resolve_model_path,
)
from mm_serve.config.compilation import (
    CompilationConfig,
    cuda_graph_batch_sizes,
    cuda_graph_num_tokens,
)
from mm_serve.config.lora import LoRAConfig
from mm_serve.config.parallel import ParallelConfig, check_tensor_parallel
from mm_serve.config.pooler import PoolerConfig, resolve_pooler_config, resolve_runner
from mm_serve.config.quantization import QuantScheme, resolve_quantization
from mm_serve.kernels.config import KernelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    """The checkpoint: where it is, its HF config, and the shapes the engine needs."""

    model: str  # as the user gave it: a folder or a hub id
    path: str  # the resolved local folder
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    tokenizer: str
    seed: int = 0
    load_format: str = "auto"  # "auto": the checkpoint's safetensors; "dummy": random weights
    chat_template: str | None = None  # Jinja text overriding the tokenizer's template
    quantization: str | None = None  # "fp8": quantize a float checkpoint's weights at load
    # "generate", or "pooling": requests are embeddings of their prompts (``config.pooler``).
    runner: str = "generate"
    pooler_config: PoolerConfig | None = None  # set with the pooling runner

    def __post_init__(self) -> None:
        # A quantization the engine does not load fails here, in the front end, naming it.
        resolve_quantization(self.hf_config, self.quantization)

    @property
    def quant_scheme(self) -> QuantScheme | None:
        """How the weights are quantized (``config.quantization``), None if they are not."""
        return resolve_quantization(self.hf_config, self.quantization)

    @property
    def text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        cfg = self.text_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        cfg = self.text_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def image_token_id(self) -> int | None:
        """The image placeholder token id of a VLM (its family's ``placeholder_token``, e.g.
        Gemma 3's ``<start_of_image>``, else the image token), None for a text-only model."""
        family = find_family(self.hf_config)
        if family is not None and family.placeholder_token is not None:
            return getattr(self.hf_config, family.placeholder_token)
        names = ("image_token_id", "image_token_index")
        values = (getattr(self.hf_config, name, None) for name in names)
        return next((value for value in values if value is not None), None)

    @property
    def video_token_id(self) -> int | None:
        """The video placeholder token id of a VLM whose family takes videos, else None."""
        family = find_family(self.hf_config)
        if family is None or family.video_processor is None:
            return None
        return getattr(self.hf_config, "video_token_id", None)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    ``num_kv_blocks`` overrides the computed size (tests use it to force preemption). On CPU
    the pool takes at most ``cpu_kv_cache_bytes``; on GPU ``gpu_memory_utilization`` of the
    device's memory minus what the process holds when the pool is sized (the weights) and the
    encoder cache's reserve; no forward pass is run to measure activations
    (``worker.kv_cache.determine_num_kv_blocks``). ``kv_cache_dtype``: "auto" (the model's
    dtype) or "fp8" / "fp8_e4m3" (float8_e4m3fn, vLLM's names; half a bf16 cache's bytes).

    Raises ``ValueError`` for another ``kv_cache_dtype``.
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose from "
                f"{', '.join(KV_CACHE_DTYPES)} (fp8 is e4m3)."
            )


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """The per-step budgets: tokens (prompt and output alike), sequences, and encoder work.

    ``max_num_encoder_input_tokens`` caps the image embedding tokens encoded per step;
    ``encoder_cache_size`` is the encoder cache's capacity in embedding tokens. Both are at
    least the largest image's token count (0 for a text-only model).
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0
    # A prefill chunk never cuts an image's placeholder range (its tokens attend to each
    # other: ``ModelFamily.bidirectional_images``); the chunk ends before an image that does
    # not fit whole, and each image must fit ``max_num_batched_tokens``.
    whole_images: bool = False
    # Schedule step n+1 while step n runs on the device (its sampled tokens stay there).
    async_scheduling: bool = False
    # "fcfs": requests in arrival order; "priority": by (priority, arrival), the lowest
    # priority's newest request preempted first (vLLM's --scheduling-policy).
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, not "
                f"{self.scheduling_policy!r}."
            )


@dataclass(frozen=True)
class MultiModalConfig:
    """Image limits and preprocessing.

    ``max_pixels`` caps an input image's width x height (larger ones are rejected);
    ``max_pixels_per_request`` caps the sum over one prompt's images (as their headers declare
    them; larger: rejected before any is decoded); ``processor_max_pixels`` overrides the
    processor's resize target, then
    ``mm_processor_kwargs`` (vLLM's, e.g. Qwen2-VL's ``{"max_pixels": ...}``) apply to every
    image (a request's own apply on top); ``max_image_tokens`` is
    the most placeholder tokens one image can expand to (0 for a text-only model).
    ``mm_processor_cache_gb`` bounds the processor cache (0 turns it off) and
    ``mm_preprocess_workers`` is the size of the preprocessing process pool.
    A video may have at most ``max_video_frames`` frames after sampling, frames of at most
    ``max_pixels`` each, and expand to at most ``max_video_tokens`` placeholder tokens (the
    least of the encoder budget, the encoder cache and ``max_model_len - 1``; 0: no videos).
    ``mm_encoder_tp_mode`` (vLLM's name) says how the tensor-parallel ranks share the vision
    tower, which each holds whole: "weights", each rank encodes every image; "data", a
    step's images are split across the ranks and the embeddings gathered
    (``worker.encoder_dp``). "weights" stays the default until the two-GPU figures say which
    is faster.
    """

    max_pixels: int = 8192 * 8192
    max_pixels_per_request: int = 4 * 8192 * 8192
    processor_max_pixels: int | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    max_image_tokens: int = 0
    mm_processor_cache_gb: float = 4.0
    mm_preprocess_workers: int = 1
    max_video_frames: int = 128
    max_video_tokens: int = 0
    mm_encoder_tp_mode: str = "weights"


_C = TypeVar("_C")
ENCODER_TP_MODES = ("weights", "data")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # EngineArgs.max_num_batched_tokens when unset


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: torch.device
    multimodal: MultiModalConfig
    compilation: CompilationConfig = CompilationConfig(level=0)
    kernels: KernelConfig = KernelConfig()
    lora: LoRAConfig | None = None  # None: LoRA off


@dataclass
class EngineArgs:
    """User-facing engine options (the ``LLM(...)`` kwargs), with vLLM's names."""

    model: str
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"  # or "fp8" (e4m3), vLLM's --kv-cache-dtype
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # or "priority" (vLLM's)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine core replicas behind one front end
    distributed_executor_backend: str | None = None  # "uni" (in the core), "mp", "ray"
    data_parallel_backend: str = "mp"  # DP engine cores: "mp" processes or "ray" actors
    device: str = "auto"
    max_pixels: int = 8192 * 8192
    max_pixels_per_request: int = 4 * 8192 * 8192  # the sum over a prompt's images
    processor_max_pixels: int | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # JSON on the command line (vLLM's flag)
    mm_processor_cache_gb: float = 4.0
    mm_preprocess_workers: int | None = None
    max_video_frames: int = 128  # sampled frames per video; more: 400
    mm_encoder_tp_mode: str = "weights"  # under TP: "weights", or "data" splits a step's images
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    enforce_eager: bool = False  # compilation level 0 (always eager on CPU)
    compilation_level: int = 2  # 0 eager, 1 CUDA graphs, 2 torch.compile + graphs
    load_format: str = "auto"
    quantization: str | None = None
    async_scheduling: bool | None = None  # on with CUDA (where it overlaps), off on CPU
    chat_template: str | None = None  # a Jinja file or the template text (vLLM's flag)
    kernel_mode: str | None = None  # None: $MM_SERVE_KERNELS, else auto
    pdl: bool | None = None  # None: on unless MM_SERVE_PDL=0
    runner: str = "auto"  # vLLM's --runner: auto (generate), generate or pooling (embeddings)
    pooler_config: dict[str, Any] | None = None  # vLLM's: {"pooling_type", "normalize"}
    enable_lora: bool = False  # serve LoRA adapters (vLLM's flags below)
    max_loras: int = 1  # distinct adapters in one step (their GPU slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory; None: max_loras

    def create_engine_config(self) -> EngineConfig:
        """Resolve the arguments (download, read config.json, pick dtype and lengths) once."""
        device = resolve_device(self.device)
        path = resolve_model_path(self.model, self.revision)
        hf_config = load_hf_config(path)
        check_tensor_parallel(hf_config, self.tensor_parallel_size)
        text_config = getattr(hf_config, "text_config", None) or hf_config
        max_model_len = resolve_max_model_len(text_config, self.max_model_len)
        runner = resolve_runner(self.runner)
        model = self._config(
            ModelConfig,
            path=path,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, text_config, hf_config, device),
            max_model_len=max_model_len,
            tokenizer=resolve_model_path(self.tokenizer, self.revision) if self.tokenizer else path,
            chat_template=load_chat_template(self.chat_template),
            runner=runner,
            pooler_config=self._pooler_config(runner, path, hf_config),
        )
        cache = self._config(CacheConfig)
        if runner == "pooling" and cache.enable_prefix_caching:
            # A prompt found in the prefix cache is not computed again, so its hidden states,
            # which the embedding is pooled from, would be missing (as vLLM long did).
            logger.info("The pooling runner turns prefix caching off.")
            cache = replace(cache, enable_prefix_caching=False)
        multimodal = self._multimodal_config(path, hf_config)
        batched_tokens = self._resolve_batched_tokens(max_model_len)
        encoder_budget, encoder_cache_size = self._resolve_encoder_budgets(
            batched_tokens, multimodal.max_image_tokens
        )
        if model.video_token_id is not None:  # a video is encoded whole, in one step
            max_video_tokens = min(encoder_budget, encoder_cache_size, max_model_len - 1)
            multimodal = replace(multimodal, max_video_tokens=max_video_tokens)
        family = find_family(hf_config)
        scheduler = self._config(
            SchedulerConfig,
            whole_images=family is not None and family.bidirectional_images,
            max_num_batched_tokens=batched_tokens,
            max_model_len=max_model_len,
            max_num_encoder_input_tokens=encoder_budget,
            encoder_cache_size=encoder_cache_size,
            async_scheduling=(
                device.type == "cuda" if self.async_scheduling is None else self.async_scheduling
            ),
        )
        parallel = self._config(ParallelConfig, data_parallel_rank=0)
        if self.compilation_level not in (0, 1, 2):
            raise ValueError(f"compilation_level must be 0, 1 or 2, not {self.compilation_level}.")
        lora = self._lora_config()
        # LoRA runs eagerly for now: its kernels are not captured in CUDA graphs yet.
        eager = self.enforce_eager or device.type != "cuda" or lora is not None
        compilation = CompilationConfig(
            level=0 if eager else self.compilation_level,
            cuda_graph_batch_sizes=cuda_graph_batch_sizes(self.max_num_seqs),
            cuda_graph_num_tokens=cuda_graph_num_tokens(batched_tokens),
        )
        kernels = KernelConfig.from_env(self.kernel_mode, self.pdl)
        return EngineConfig(
            model, cache, scheduler, parallel, device, multimodal, compilation, kernels, lora
        )

    def _pooler_config(self, runner: str, path: str, hf_config: Any) -> PoolerConfig | None:
        """The pooling runner's settings (``config.pooler``); None for the generate runner,
        which takes no ``pooler_config`` (a ValueError)."""
        if runner == "pooling":
            return resolve_pooler_config(path, hf_config, self.pooler_config)
        if self.pooler_config is not None:
            raise ValueError("pooler_config needs the pooling runner (--runner pooling).")
        return None

    def _lora_config(self) -> LoRAConfig | None:
        """The LoRA limits with ``enable_lora``, else None.

        Raises:
            ValueError: a bad limit (``LoRAConfig``), or LoRA with tensor parallelism.
        """
        if not self.enable_lora:
            return None
        if self.tensor_parallel_size > 1:
            raise ValueError("enable_lora does not run with tensor parallelism yet.")
        return self._config(LoRAConfig)

    def _multimodal_config(self, path: str, hf_config: Any) -> MultiModalConfig:
        """Image limits; for a VLM, the largest image's token count from its processor."""
        from mm_serve.encoders.processors import get_image_processor

        max_image_tokens = 0
        family = find_family(hf_config)
        if family is not None and family.image_processor is not None:
            processor = get_image_processor(
                path, hf_config, self.processor_max_pixels, self.mm_processor_kwargs
            )
            max_image_tokens = processor.max_num_tokens
        if self.mm_processor_cache_gb < 0:
            raise ValueError("mm_processor_cache_gb must not be negative.")
        workers = self.mm_preprocess_workers
        if workers is None:  # leave cores to the engine and the API server
            workers = max(1, min(8, (os.cpu_count() or 2) // 2))
        if workers < 1:
            raise ValueError("mm_preprocess_workers must be at least 1.")
        if self.max_video_frames < 1:
            raise ValueError("max_video_frames must be at least 1.")
        if self.max_pixels_per_request < 1:
            raise ValueError("max_pixels_per_request must be at least 1.")
        if self.mm_encoder_tp_mode not in ENCODER_TP_MODES:
            raise ValueError(
                f"mm_encoder_tp_mode is one of {ENCODER_TP_MODES}, not {self.mm_encoder_tp_mode!r}."
            )
        return self._config(
            MultiModalConfig,
            max_image_tokens=max_image_tokens,
            mm_preprocess_workers=workers,
            max_video_tokens=0,  # set once the encoder budgets are known
        )

    def _config(self, cls: type[_C], **resolved: Any) -> _C:
        """A ``cls`` of ``resolved`` and, for its other fields, the arguments of their names."""
        same = {f.name: getattr(self, f.name) for f in fields(cls) if f.name not in resolved}
        return cls(**same, **resolved)

    def _resolve_encoder_budgets(self, batched_tokens: int, max_image_tokens: int):
        """(encoder tokens per step, encoder cache size): default to the token budget, and
        never below the largest image, which must fit in one step and in the cache."""
        budgets = []
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if value is None:
                value = max(batched_tokens, max_image_tokens) if max_image_tokens else 0
            elif value < max_image_tokens:
                raise ValueError(
                    f"{name}={value} is below the largest image's {max_image_tokens} tokens; "
                    "raise it or lower processor_max_pixels."
                )
            budgets.append(value)
        return tuple(budgets)

    def _resolve_batched_tokens(self, max_model_len: int) -> int:
        tokens = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if not self.enable_chunked_prefill and tokens < max_model_len:
            # Without chunking a whole prompt must fit in one step.
            tokens = max_model_len
        if tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1.")
        return tokens


def load_chat_template(value: str | None) -> str | None:
    """A chat template given as a file path or as the Jinja text itself (vLLM's
    ``--chat-template``) -> the Jinja text; None stays None.

    Raises:
        ValueError: ``value`` is neither a readable file nor Jinja text (it has no ``{``), or
            the Jinja text does not parse.
    """
    if value is None:
        return None
    if "{" not in value:  # Jinja text always has a {{ or a {%: this names a file
        try:
            value = Path(value).expanduser().read_text()
        except OSError as e:
            raise ValueError(
                f"chat_template {value!r} is neither Jinja text nor a readable file ({e.strerror})."
            ) from e
    import jinja2

    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not a valid Jinja template: {e}") from e
    return value


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda if available, else cpu; any other name as ``torch.device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
