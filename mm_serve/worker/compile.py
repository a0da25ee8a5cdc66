"""The LM forward of the steps that are not decode-only, compiled by ``torch.compile`` at
compilation level 2.

Dynamo traces the forward from input embeddings once, dynamic in the token count: the kernels'
pure-torch references (``kernels.dispatch.use_kernels`` is False while tracing) for Inductor to
fuse around the cuBLAS matmuls, and each layer's attention as the opaque custom op
``mm_serve::attention`` (RoPE, KV-cache write, paged attention). That op reads the step's
metadata from ``step_metadata``, so the graph serves any step and the mixed-step CUDA graphs
(``worker.cuda_graphs``) capture it whole. Decode-only steps keep the eager forward (the fused
GEMV kernels). Inductor's kernels are cached on disk (``compile_cache_dir``)."""

from __future__ import annotations

import hashlib
import logging
import os
import time
import types
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from mm_serve.config import EngineConfig
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.models.layers.attention import register_layers, step_metadata
from mm_serve.utils.cache_dir import cache_root

logger = logging.getLogger(__name__)

# forward(positions [T] or [3, T], inputs_embeds [T, hidden], metadata) -> [T, hidden]
LMForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def compile_cache_dir(config: EngineConfig) -> Path:
    """``$MM_SERVE_CACHE_DIR`` (default ``~/.cache/mm_serve``) ``/torch_compile/<key>``, the
    key a hash of the model's config, dtype, mm_serve's and torch's versions."""
    try:
        code_version = version("mm_serve")
    except PackageNotFoundError:
        code_version = "source"
    parts = (config.model.hf_config.to_json_string(), str(config.model.dtype), code_version)
    key = hashlib.sha256("\n".join((*parts, torch.__version__)).encode()).hexdigest()[:16]
    return cache_root() / "torch_compile" / key


class CompiledForward:
    """``model``'s forward from input embeddings under ``torch.compile`` (an ``LMForward``).

    The first call traces and compiles (``compile_seconds``); later calls of any token count
    but 1 reuse the graph (Dynamo specialises a dimension of size 1). ``model``'s attention
    layers are registered for ``mm_serve::attention``.

    Dynamo keeps its compiled entries on the traced function's code object, and each entry
    guards on ``self.model``'s class. Each instance therefore traces its own copy of
    ``_forward``'s code: engines built one after another in one process (tests, notebooks)
    would otherwise add up against Dynamo's recompile limit (8), past which ``fullgraph``
    compilation fails.
    """

    def __init__(self, model: torch.nn.Module, cache_dir: Path, backend: str = "inductor") -> None:
        register_layers(model.attention_layers())
        cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)  # read when Inductor compiles
        self.model = model
        code = CompiledForward._forward.__code__.replace()  # a new object: this instance's cache
        forward = types.FunctionType(code, globals(), "_forward")
        self.compiled = torch.compile(
            types.MethodType(forward, self), fullgraph=True, backend=backend
        )
        self.compile_seconds: float | None = None

    def _forward(self, positions: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.model(None, positions, None, inputs_embeds)

    def __call__(
        self, positions: torch.Tensor, inputs_embeds: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        start = time.perf_counter() if self.compile_seconds is None else None
        if start is not None:  # the token count is the one dynamic dimension
            torch._dynamo.maybe_mark_dynamic(inputs_embeds, 0)
            torch._dynamo.maybe_mark_dynamic(positions, positions.ndim - 1)
        with step_metadata(metadata):
            hidden_states = self.compiled(positions, inputs_embeds)
        if start is not None:
            self.compile_seconds = time.perf_counter() - start
            logger.info("torch.compile of the LM forward: %.1f s", self.compile_seconds)
        return hidden_states


def lm_forward(model: torch.nn.Module, config: EngineConfig) -> LMForward:
    """The forward from input embeddings that the steps not decode-only run: compiled at
    compilation level 2 on CUDA, else ``model`` itself."""
    if config.compilation.level == 2 and config.device.type == "cuda":
        return CompiledForward(model, compile_cache_dir(config))
    return lambda positions, embeds, metadata: model(None, positions, metadata, embeds)
