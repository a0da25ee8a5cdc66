"""The start-up GEMM warm-up's choice of shapes (``worker.gemm_warmup``); its launches need
CUDA and are measured by ``benchmarks/gemm_kernels.py``."""

import torch
from torch import nn

from mm_serve.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from mm_serve.worker.gemm_warmup import MAX_COUNTS, lm_gemm_shapes, token_counts


def _layer():
    layer = nn.Module()
    layer.qkv = ColumnParallelLinear(8, 12, bias=True)
    layer.o = RowParallelLinear(8, 8, bias=True)
    layer.gate_up = MergedColumnParallelLinear(8, [16, 16])
    layer.down = RowParallelLinear(16, 8)
    return layer


def test_one_gemm_per_weight_shape_and_bias_across_layers():
    """Two identical layers and a vision ``nn.Linear`` give one GEMM per distinct shape of the
    LM's layers: a column-parallel layer's with its bias and without, a row-parallel layer's
    without (its bias is added after the all-reduce)."""
    model = nn.Module()
    model.layers = nn.ModuleList([_layer(), _layer()])
    model.vision = nn.Linear(8, 8)
    gemms = lm_gemm_shapes(model)
    found = sorted((tuple(w.shape), b is not None) for w, b in gemms)
    assert found == [
        ((8, 8), False),
        ((8, 16), False),
        ((12, 8), False),
        ((12, 8), True),
        ((32, 8), False),
    ]
    first = model.layers[0]
    assert any(b is first.qkv.bias for _, b in gemms)
    assert all(w.dtype == torch.float32 for w, _ in gemms)


def test_token_counts_every_eighth_up_to_the_budget_then_wider():
    """8,192 tokens: 1, 8, 16, ..., 8,192; an odd maximum is included; a larger budget keeps
    the number of counts at ``MAX_COUNTS`` (plus the two ends)."""
    counts = token_counts(8192)
    assert counts[:3] == [1, 8, 16] and counts[-1] == 8192 and len(counts) == 1025
    assert token_counts(100)[-2:] == [96, 100]
    wide = token_counts(65536)
    assert wide[:2] == [1, 64] and wide[-1] == 65536 and len(wide) <= MAX_COUNTS + 1
