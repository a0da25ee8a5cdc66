"""Quantized checkpoints' schemes and tensors (``models.layers.quantization``) against the
tools that write them: compressed-tensors' preset schemes and packing, transformers' configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import mm_serve  # noqa: F401 - before transformers (a CPU torch beside a CUDA torchvision)
from mm_serve.config.quantization import QuantScheme, UnsupportedQuantization, quant_scheme
from mm_serve.kernels.quant_linear import dequantize_int4, fp8_linear_ref, quantize_fp8_rows
from mm_serve.models.layers.quantization import canonical_weights, unpack_int4_rows

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    preset_name_to_scheme,
)

FORMATS = {name: "float-quantized" for name in ("FP8_DYNAMIC", "FP8_BLOCK", "FP8", "W8A16")}


def preset_config(preset: str) -> SimpleNamespace:
    """An HF config whose ``quantization_config`` is compressed-tensors' for ``preset``."""
    scheme = preset_name_to_scheme(preset, ["Linear"])
    fmt = FORMATS.get(preset, "pack-quantized" if preset.startswith("W4") else "naive-quantized")
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"])
    return SimpleNamespace(quantization_config=config.to_dict())


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("FP8_DYNAMIC", QuantScheme("fp8", input_group_size=None)),
        ("FP8_BLOCK", QuantScheme("fp8", 128, block_rows=128, input_group_size=128)),
        ("W4A16", QuantScheme("int4", 128, symmetric=True)),
        ("W4A16_ASYM", QuantScheme("int4", 128, symmetric=False)),
    ],
)
def test_schemes_of_compressed_tensors_presets(preset, expected):
    assert quant_scheme(preset_config(preset)) == expected


@pytest.mark.parametrize("preset", ["FP8", "W8A8", "W8A16", "NVFP4"])
def test_schemes_not_loaded_are_refused_by_name(preset):
    """Static activation scales, int8 and FP4 are named, never loaded as something else."""
    with pytest.raises(UnsupportedQuantization, match="compressed-tensors format"):
        quant_scheme(preset_config(preset))


def test_fine_grained_fp8_scheme():
    from transformers import FineGrainedFP8Config

    config = SimpleNamespace(quantization_config=FineGrainedFP8Config().to_dict())
    assert quant_scheme(config) == QuantScheme("fp8", 128, block_rows=128, input_group_size=128)


def test_other_quantization_methods_are_refused_by_name():
    from transformers import GPTQConfig

    config = SimpleNamespace(quantization_config=GPTQConfig(bits=4).to_dict())
    with pytest.raises(UnsupportedQuantization, match="'gptq' is not supported"):
        quant_scheme(config)
    assert quant_scheme(SimpleNamespace()) is None


def test_int4_rows_unpack_as_compressed_tensors_packs_them():
    values = torch.randint(-8, 8, (16, 256), dtype=torch.int8, generator=torch.manual_seed(0))
    assert torch.equal(unpack_int4_rows(pack_to_int32(values, 4, packed_dim=1)), values)
    zero_point = values[:, :2].contiguous()  # [rows, groups], packed along the rows
    packed = pack_to_int32(zero_point, 4, packed_dim=0)
    int4 = QuantScheme("int4", 128)
    ((name, unpacked),) = canonical_weights([("l.weight_zero_point", packed)], int4)
    assert name == "l.weight_zero_point" and torch.equal(unpacked, zero_point)
    checkpoint = [("l.weight_packed", packed), ("l.weight_shape", zero_point)]
    assert [n for n, _ in canonical_weights(checkpoint, int4)] == ["l.weight"]


def test_fp8_block_scales_repeat_over_their_rows():
    blocks = QuantScheme("fp8", 128, block_rows=128, input_group_size=128)
    scale_inv = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)  # [N/128, K/128]
    ((name, scale),) = canonical_weights([("l.weight_scale_inv", scale_inv)], blocks)
    assert name == "l.weight_scale" and scale.dtype == torch.float32 and scale.shape == (256, 2)
    assert torch.equal(scale[127], scale_inv[0].float())
    assert torch.equal(scale[128], scale_inv[1].float())


def test_int4_dequantize_is_q_minus_z_times_s_per_group():
    q = torch.tensor([[1, -2, 3, 4]], dtype=torch.int8)
    scale, zero = torch.tensor([[0.5, 2.0]]), torch.tensor([[1, -1]], dtype=torch.int8)
    expected = torch.tensor([[0.0, -1.5, 8.0, 10.0]])
    assert torch.equal(dequantize_int4(q, scale, zero, group_size=2), expected)
    assert torch.equal(dequantize_int4(q, scale, None, 2), torch.tensor([[0.5, -1.0, 6.0, 8.0]]))


def test_fp8_linear_quantizes_each_token_to_its_own_range():
    x = torch.tensor([[1.0, -448.0, 3.0], [0.001, 0.002, -0.003]])
    x_q, scale = quantize_fp8_rows(x)
    assert x_q.dtype == torch.float8_e4m3fn and scale.shape == (2, 1)
    assert torch.allclose(scale.squeeze(1), torch.tensor([1.0, 0.003 / 448]))
    assert torch.allclose(x_q.float() * scale, x, rtol=0.07)  # e4m3: 3 mantissa bits
    weight, weight_scale = torch.eye(3).to(torch.float8_e4m3fn), torch.full((3, 1), 2.0)
    assert torch.allclose(fp8_linear_ref(x, weight, weight_scale, None), 2 * x, rtol=0.07)
    assert torch.equal(fp8_linear_ref(x, weight, weight_scale), 2 * x)  # W8A16


def test_fp8_groups_quantize_and_scale_their_own_features():
    x = torch.tensor([[1.0, 2.0, 100.0, -300.0]])
    x_q, scale = quantize_fp8_rows(x, group_size=2)
    assert scale.shape == (1, 2) and torch.allclose(scale, torch.tensor([[2 / 448, 300 / 448]]))
    weight = torch.ones(1, 4).to(torch.float8_e4m3fn)
    block_scale = torch.tensor([[1.0, 0.5]])  # features 0-1 and 2-3
    y = fp8_linear_ref(x, weight, block_scale, None, input_group_size=2)
    assert torch.allclose(y, torch.tensor([[3.0 + 0.5 * -200.0]]), rtol=0.07)
