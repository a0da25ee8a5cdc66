"""How the engine spreads over devices and hosts: tensor-parallel ranks and data-parallel
replicas (``ParallelConfig``, part of ``config.EngineConfig``), and the start-up check that a
model splits over the ranks (``check_tensor_parallel``)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

PARALLEL_BACKENDS = ("mp", "ray")
EXECUTOR_BACKENDS = ("uni", *PARALLEL_BACKENDS)


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine spreads over devices and hosts.

    ``tensor_parallel_size`` ranks split each model (``check_tensor_parallel``); their workers
    are local processes (``distributed_executor_backend`` "mp") or Ray actors ("ray"). With
    one rank, "uni" runs the model in the engine core's process (vLLM's name), and "mp" in one
    worker process, which prepares each step while the core schedules the next. None: "uni"
    with one rank, else "mp".
    ``data_parallel_size`` engine core replicas, each a whole engine with its own scheduler
    and caches, serve behind one front end, which routes every request to one of them; they
    are local processes ("mp") or Ray actors ("ray"). ``data_parallel_rank`` is the replica
    this engine core is (the front end sets it per replica); on CUDA with "mp" replica ``r``
    takes the devices from ``r * tensor_parallel_size`` on.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    distributed_executor_backend: str | None = None
    data_parallel_backend: str = "mp"

    def __post_init__(self) -> None:
        """Raises ValueError on a size below 1, a rank out of range, an unknown backend ("uni"
        with more than one rank), or the ray backend without Ray installed."""
        size, rank = self.data_parallel_size, self.data_parallel_rank
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"data_parallel_size {size} (rank {rank}) must be at least 1.")
        if self.distributed_executor_backend is None:
            default = "uni" if self.tensor_parallel_size == 1 else "mp"
            object.__setattr__(self, "distributed_executor_backend", default)
        executor, backend = self.distributed_executor_backend, self.data_parallel_backend
        if executor not in EXECUTOR_BACKENDS or backend not in PARALLEL_BACKENDS:
            raise ValueError(
                f"The executor backend is one of {EXECUTOR_BACKENDS} ({executor!r} given), the "
                f"data-parallel backend one of {PARALLEL_BACKENDS} ({backend!r} given)."
            )
        if executor == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("The uni executor backend runs one rank; use mp or ray for more.")
        backends = (executor, backend)
        if "ray" in backends and importlib.util.find_spec("ray") is None:
            raise ValueError("The ray backend needs Ray: pip install 'mm_serve[ray]'.")

    @property
    def processes_per_host(self) -> int:
        """The engine processes that share one host's CPU cores: the TP ranks of every local
        replica (Ray places its actors on hosts of their own)."""
        replicas = self.data_parallel_size if self.data_parallel_backend == "mp" else 1
        return self.tensor_parallel_size * replicas


def check_tensor_parallel(hf_config: Any, tp_size: int) -> None:
    """Check that the LM of ``hf_config`` splits over ``tp_size`` ranks, at start-up.

    Attention heads and the MLP's intermediate size (each expert's too) are split evenly; KV
    heads are split, or replicated when the ranks outnumber them (``tp_size`` a multiple of
    their count). The vocabulary needs no check: each rank holds ``ceil(vocab / tp_size)``
    rows, the last one zero-padded (``models/layers/embedding.py``). A vision tower is
    replicated on each rank.

    Raises:
        ValueError: ``tp_size`` is below 1, or a count above does not divide as said.
    """
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, not {tp_size}.")
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    problems = []
    if heads % tp_size:
        problems.append(f"num_attention_heads={heads}")
    if kv_heads % tp_size and tp_size % kv_heads:
        problems.append(f"num_key_value_heads={kv_heads} (nor is the size a multiple of it)")
    for key in ("intermediate_size", "moe_intermediate_size"):  # each expert split too
        size = getattr(text, key, None)
        if size is not None and size % tp_size:
            problems.append(f"{key}={size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the model's "
            f"{', '.join(problems)}; choose a size that divides them."
        )
