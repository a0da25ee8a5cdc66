"""The FP8 (e4m3) KV cache, ``kv_cache_dtype="fp8"``: its reference (K and V rounded to e4m3,
saturated at +-448, read back as they are) against HF transformers whose attention sees its
keys and values rounded the same way; twice the tokens in the same memory; the Triton kernels
on an FP8 cache are in ``test_kernels_triton.py``."""

from __future__ import annotations

import random

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.config import EngineArgs
from mm_serve.kernels.attention import reshape_and_cache_ref
from tests.fixtures.leaks import assert_llm_idle

FP8 = torch.float8_e4m3fn
ENGINE = dict(multiprocess=False, block_size=4, cpu_kv_cache_bytes=1 << 20, max_model_len=256)


def rounded_to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(FP8).to(x.dtype)


def test_the_write_rounds_and_saturates():
    key = torch.tensor([[[1000.0, -1000.0, 0.3, 447.9]]])
    cache = torch.zeros(2, 1, 4, 1, 4, dtype=FP8)
    reshape_and_cache_ref(key, -key, cache, torch.tensor([2]))
    assert cache[0, 0, 2, 0].float().tolist() == [
        448.0,
        -448.0,
        rounded_to_fp8(key)[0, 0, 2],
        448.0,
    ]
    assert torch.equal(cache[1, 0, 2], (-cache[0, 0, 2].float()).to(FP8))


def test_other_kv_cache_dtypes_are_refused_by_name(qwen2_path):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2'"):
        EngineArgs(model=qwen2_path, kv_cache_dtype="fp8_e5m2").create_engine_config()


@pytest.fixture(scope="module")
def hf_fp8_reference(qwen2_path):
    """HF's Qwen2 in float32, eager attention over keys and values rounded to e4m3."""
    import transformers.models.qwen2.modeling_qwen2 as modeling
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        qwen2_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    attend = modeling.eager_attention_forward

    def attend_fp8(module, query, key, value, *args, **kwargs):
        return attend(module, query, rounded_to_fp8(key), rounded_to_fp8(value), *args, **kwargs)

    @torch.inference_mode()
    def greedy(prompt: list[int], max_new_tokens: int) -> list[int]:
        modeling.eager_attention_forward = attend_fp8
        try:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens)  # fmt: skip
        finally:
            modeling.eager_attention_forward = attend
        return out[0, len(prompt) :].tolist()

    return greedy


@pytest.mark.parametrize(
    "engine_args", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"]
)
def test_greedy_tokens_equal_hf_with_fp8_keys_and_values(qwen2_path, hf_fp8_reference, engine_args):
    rng = random.Random(7)
    prompts = [[rng.randrange(400) for _ in range(n)] for n in (5, 23, 40)]
    llm = LLM(qwen2_path, kv_cache_dtype="fp8", **ENGINE, **engine_args)
    assert all(cache.dtype == FP8 for cache in llm.engine_core.model_runner.kv_caches)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for _ in range(2):  # the second round reads its prefixes from the cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.outputs[0].token_ids == hf_fp8_reference(prompt, 12)
    assert_llm_idle(llm)
    llm.shutdown()


def test_twice_the_tokens_in_the_same_memory(qwen2_path):
    blocks = {}
    for dtype in ("auto", "fp8"):
        llm = LLM(qwen2_path, kv_cache_dtype=dtype, **ENGINE)
        blocks[dtype] = llm.engine_core.model_runner.kv_caches[0].shape[1]
        llm.shutdown()
    assert blocks["fp8"] == 4 * blocks["auto"]  # float32 model: 4 bytes a value against 1
