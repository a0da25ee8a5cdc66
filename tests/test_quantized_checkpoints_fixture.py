"""The quantized test checkpoints (tests/fixtures/quantized_checkpoints.py): each scheme's
folder has compressed-tensors' config and tensors, the vision tower and ``lm_head`` unquantized,
and a reference forward whose greedy tokens are deterministic and not degenerate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("compressed_tensors")

from tests.fixtures.images import TEXT_ONLY, generated  # noqa: E402
from tests.fixtures.quantized_checkpoints import (  # noqa: E402
    FAMILIES,
    SCHEMES,
    build_quantized_checkpoint,
    reference_greedy,
    reference_model,
)

IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is in the image?"
CASES = [(TEXT_ONLY, []), (IMAGE_PROMPT, [generated(64, 48, seed=1)])]
# (family, scheme): every scheme on Qwen2-VL, and one of each format on the other families.
CHECKPOINTS = [("qwen2_vl", scheme) for scheme in SCHEMES] + [
    ("qwen2_5_vl", "W4A16"),
    ("qwen3_vl", "FP8_DYNAMIC"),
    ("qwen3_vl", "W4A16_ASYM"),
]
# Tensors each format stores per quantized Linear, with their dtypes.
FP8_TENSORS = {"weight": torch.float8_e4m3fn, "weight_scale": torch.float32}
INT4_TENSORS = {"weight_packed": torch.int32, "weight_scale": torch.float32}
INT4_TENSORS_ASYM = {**INT4_TENSORS, "weight_zero_point": torch.int32}
EXPECTED = {
    "FP8_DYNAMIC": ("float-quantized", FP8_TENSORS, "channel", "token"),
    "FP8_BLOCK": ("float-quantized", FP8_TENSORS, "block", "group"),
    "W4A16": ("pack-quantized", INT4_TENSORS, "group", None),
    "W4A16_ASYM": ("pack-quantized", INT4_TENSORS_ASYM, "group", None),
}


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=lambda c: f"{c[0]}-{c[1]}")
def checkpoint(request, tmp_path_factory) -> tuple[str, str, str]:
    family, scheme = request.param
    path = build_quantized_checkpoint(tmp_path_factory.mktemp(f"{family}-{scheme}"), family, scheme)
    return path, family, scheme


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(Path(path) / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def test_config_has_the_scheme(checkpoint):
    path, _, scheme = checkpoint
    config = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    fmt, _, weight_strategy, activation_strategy = EXPECTED[scheme]
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == fmt
    # The ignored Linear layers by their checkpoint names, as published checkpoints list them.
    assert "lm_head" in config["ignore"]
    assert all("visual." in name for name in config["ignore"] if name != "lm_head")
    (group,) = config["config_groups"].values()
    assert group["targets"] == ["Linear"]
    weights = group["weights"]
    assert weights["strategy"] == weight_strategy
    assert weights["symmetric"] == (scheme != "W4A16_ASYM")
    assert weights["num_bits"] == (8 if fmt == "float-quantized" else 4)
    if weight_strategy == "group":
        assert weights["group_size"] == 128
    if weight_strategy == "block":
        assert weights["block_structure"] == [128, 128]
    activations = group["input_activations"]
    if activation_strategy is None:
        assert activations is None
    else:
        assert activations["dynamic"] is True and activations["strategy"] == activation_strategy


def test_tensors_in_the_format(checkpoint):
    path, _, scheme = checkpoint
    tensors = _tensors(path)
    _, expected, _, _ = EXPECTED[scheme]
    quantized = {name.rsplit(".", 1)[0] for name in tensors if name.endswith("weight_scale")}
    assert len(quantized) >= 7 * 2  # q, k, v, o, gate, up, down of every layer
    for layer in quantized:
        assert "visual" not in layer and "lm_head" not in layer
        for suffix, dtype in expected.items():
            assert tensors[f"{layer}.{suffix}"].dtype == dtype, f"{layer}.{suffix}"
        if "weight_packed" in expected:  # 8 int4 values per int32, the original shape beside
            out_features, in_features = tensors[f"{layer}.weight_shape"].tolist()
            assert tensors[f"{layer}.weight_packed"].shape == (out_features, in_features // 8)
            assert tensors[f"{layer}.weight_scale"].shape == (out_features, in_features // 128)
    float_weights = [n for n in tensors if "visual" in n or "embed_tokens" in n]
    assert float_weights and all(tensors[n].dtype == torch.float32 for n in float_weights)


def test_reference_greedy_is_deterministic_and_not_degenerate(checkpoint):
    path, family, scheme = checkpoint
    assert family in FAMILIES
    first = reference_greedy(reference_model(family, scheme), path, CASES, 12)
    again = reference_greedy(reference_model(family, scheme), path, CASES, 12)
    for (_, tokens, logprobs), (_, tokens_again, _) in zip(first, again, strict=True):
        assert len(tokens) == 12 and tokens == tokens_again
        assert len(set(tokens)) > 3, tokens  # a degenerate model is no reference
        assert logprobs.shape[0] == 12
    image_prompt_ids = first[1][0]  # <|image_pad|> repeated once per image token (4 or more)
    assert max(map(image_prompt_ids.count, image_prompt_ids)) >= 4


def test_matches_llmcompressor_oneshot(tmp_path):
    """Where llmcompressor imports, its ``oneshot`` writes the same tensors and config."""
    pytest.importorskip("llmcompressor")
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from tests.fixtures.quantized_checkpoints import IGNORE, TEXT_OVERRIDES, _load
    from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

    for scheme in SCHEMES:
        ours = build_quantized_checkpoint(tmp_path / scheme, "qwen2_vl", scheme)
        base = tmp_path / f"{scheme}-base"
        build_tiny_vlm_checkpoint(base, "qwen2_vl", text_overrides=TEXT_OVERRIDES["qwen2_vl"])
        model = _load(base)
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=IGNORE)
        oneshot(model=model, recipe=recipe)
        oneshot_path = tmp_path / f"{scheme}-oneshot"
        model.save_pretrained(oneshot_path, save_compressed=True)
        theirs, mine = _tensors(oneshot_path), _tensors(ours)
        assert theirs.keys() == mine.keys()
        for name, tensor in mine.items():
            assert torch.equal(tensor, theirs[name]), name
        configs = [json.loads((Path(p) / "config.json").read_text()) for p in (ours, oneshot_path)]
        assert configs[0]["quantization_config"] == configs[1]["quantization_config"]
