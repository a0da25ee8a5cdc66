"""Quantized checkpoints through the engine: greedy tokens equal the format's reference forward
(compressed-tensors' fake-quant model, ``tests/fixtures/quantized_checkpoints``) on the same
weights, whole and chunked with the prefix cache on, the weights held quantized."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors")

from mm_serve import LLM, SamplingParams  # noqa: E402
from mm_serve.config.quantization import UnsupportedQuantization  # noqa: E402
from tests.fixtures.images import TEXT_ONLY, generated  # noqa: E402
from tests.fixtures.leaks import assert_llm_idle  # noqa: E402
from tests.fixtures.quantized_checkpoints import (  # noqa: E402
    REFUSED_SCHEMES,
    SCHEMES,
    TEXT_OVERRIDES,
    build_quantized_checkpoint,
    reference_greedy,
    reference_model,
)
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint  # noqa: E402

IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is in the image?"
TWO_IMAGES = (
    "Compare <|vision_start|><|image_pad|><|vision_end|> with "
    "<|vision_start|><|image_pad|><|vision_end|>, please."
)
CASES = [
    (TEXT_ONLY, []),
    (IMAGE_PROMPT, [generated(64, 48, seed=1)]),
    (TWO_IMAGES, [generated(56, 84, seed=2), generated(96, 40, seed=3)]),
]
MAX_NEW_TOKENS = 10
CHECKPOINTS = [("qwen2_vl", scheme) for scheme in SCHEMES] + [
    ("qwen2_5_vl", "W4A16"),
    ("qwen3_vl", "FP8_DYNAMIC"),
    ("qwen3_vl", "W4A16_ASYM"),
]
WEIGHT_DTYPES = {"FP8_DYNAMIC": torch.float8_e4m3fn, "FP8_BLOCK": torch.float8_e4m3fn}


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=lambda c: f"{c[0]}-{c[1]}")
def quantized(request, tmp_path_factory):
    """(scheme, folder, the reference's (prompt ids, greedy ids) per case)."""
    family, scheme = request.param
    path = build_quantized_checkpoint(tmp_path_factory.mktemp(f"{family}-{scheme}"), family, scheme)
    reference = reference_greedy(reference_model(family, scheme), path, CASES, MAX_NEW_TOKENS)
    return scheme, path, [(prompt_ids, tokens) for prompt_ids, tokens, _ in reference]


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": True}],
    ids=["whole", "chunked"],
)
def test_greedy_tokens_equal_the_reference(quantized, engine_args):
    scheme, path, expected = quantized
    llm = LLM(path, multiprocess=False, **engine_args)
    layer = llm.engine_core.model_runner.model.model.layers[0].mlp.gate_up_proj
    assert layer.quant_method is not None
    assert layer.weight.dtype == WEIGHT_DTYPES.get(scheme, torch.int8)
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in CASES]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    for _ in range(2):  # the second round hits the prefix cache
        outputs = llm.generate(prompts, params, use_tqdm=False)
        got = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs]
        assert got == expected
    assert_llm_idle(llm)
    llm.shutdown()


@pytest.mark.parametrize("scheme", REFUSED_SCHEMES)
def test_a_scheme_not_served_is_refused_by_name(scheme, tmp_path):
    """Never loaded as something else: an int8 checkpoint is an error naming its format."""
    path = build_quantized_checkpoint(tmp_path, "qwen2_vl", scheme)
    with pytest.raises(UnsupportedQuantization, match="compressed-tensors format '[a-z-]+'"):
        LLM(path, multiprocess=False)


@pytest.mark.parametrize("scheme", ["FP8_BLOCK", "W4A16_ASYM"])
def test_two_tensor_parallel_ranks_give_the_reference_tokens(scheme, tmp_path):
    """Each rank holds its shard of the quantized rows, groups, blocks and zero points (gloo)."""
    path = build_quantized_checkpoint(tmp_path, "qwen2_vl", scheme)
    reference = reference_greedy(reference_model("qwen2_vl", scheme), path, CASES, MAX_NEW_TOKENS)
    llm = LLM(path, tensor_parallel_size=2, device="cpu", max_model_len=512)
    try:
        prompts = [{"prompt": t, "multi_modal_data": {"image": images}} for t, images in CASES]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [tokens for _, tokens, _ in reference]
        assert_llm_idle(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_online_fp8_is_compressed_tensors_fp8_dynamic(family, tmp_path):
    """``quantization="fp8"`` on a float checkpoint: the tokens of compressed-tensors'
    FP8_DYNAMIC (per-channel weights, per-token activations) on the same weights."""
    path = build_tiny_vlm_checkpoint(tmp_path, family, 0, text_overrides=TEXT_OVERRIDES[family])
    model = reference_model(family, "FP8_DYNAMIC")
    reference = reference_greedy(model, path, CASES, MAX_NEW_TOKENS)
    llm = LLM(path, multiprocess=False, quantization="fp8")
    layer = llm.engine_core.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn
    prompts = [{"prompt": t, "multi_modal_data": {"image": images}} for t, images in CASES]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [tokens for _, tokens, _ in reference]
    llm.shutdown()


def test_online_quantization_of_a_quantized_checkpoint_is_refused(tmp_path):
    path = build_quantized_checkpoint(tmp_path, "qwen2_vl", "W4A16")
    with pytest.raises(ValueError, match="quantized already"):
        LLM(path, multiprocess=False, quantization="fp8")
    with pytest.raises(ValueError, match="quantization='int8' is not supported"):
        LLM(path, multiprocess=False, quantization="int8")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_random_weights_for_a_quantized_config(scheme, tmp_path):
    """``load_format="dummy"`` (the benchmarks' published configs): random float weights,
    quantized as the config says, held in its layout, and served."""
    path = build_quantized_checkpoint(tmp_path, "qwen2_vl", scheme)
    llm = LLM(path, multiprocess=False, load_format="dummy")
    layer = llm.engine_core.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == WEIGHT_DTYPES.get(scheme, torch.int8)
    assert hasattr(layer, "weight_zero_point") == scheme.endswith("ASYM")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (output,) = llm.generate([TEXT_ONLY], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4
    llm.shutdown()
