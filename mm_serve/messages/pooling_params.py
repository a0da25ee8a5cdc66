"""Pooling parameters of one embedding request, in the shape of vLLM's ``PoolingParams``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """How to make one prompt's embedding from its final hidden states (the pooling runner:
    ``mm_serve.config.pooler``).

    ``dimensions``: keep the first ``dimensions`` values (Matryoshka), before normalising;
    ``normalize``: L2-normalise (None: the model's ``PoolerConfig.normalize``);
    ``pooling_type``: "LAST" or "MEAN", set by the front end from the model's ``PoolerConfig``
    (``frontend.processor.resolve_pooling_params`` checks and fills these).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None
