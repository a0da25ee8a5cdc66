"""LoRA pieces without a full engine run: the batched shrink/expand references (and the Triton
kernels on CUDA) against a per-token loop; adapter loading of peft's folders into our fused
layers and its refusals; the scheduler's ``max_loras`` per step; the adapter in the block hash;
an engine refusing a bad adapter with nothing left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mm_serve import LLM, LoRARequest, SamplingParams
from mm_serve.cache.block_hash import block_extra_keys
from mm_serve.config import CacheConfig, SchedulerConfig
from mm_serve.config.lora import LoRAConfig
from mm_serve.kernels.lora import lora_expand_ref, lora_shrink_ref
from mm_serve.lora import LoRAAdapterError
from mm_serve.lora.adapter import ModelLoRATargets, load_adapter
from mm_serve.messages.request import Request
from mm_serve.sched.scheduler import Scheduler
from tests.fixtures.leaks import assert_llm_idle
from tests.fixtures.lora_adapters import build_lora_adapters
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

# ---- kernels -------------------------------------------------------------------------------


def per_token(x, lora_a, lora_b, indices):
    """``B[i] (A[i] x)`` token by token (zero for slot -1): the definition."""
    rows = [
        torch.zeros(lora_b.shape[1]) if i < 0 else lora_b[i] @ (lora_a[i] @ x[t])
        for t, i in enumerate(indices.tolist())
    ]
    return torch.stack(rows)


def test_shrink_expand_references_equal_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(11, 24, generator=gen), torch.randn(11, 40, generator=gen)
    lora_a, lora_b = torch.randn(3, 8, 24, generator=gen), torch.randn(3, 16, 8, generator=gen)
    indices = torch.tensor([0, -1, 2, 2, 1, -1, 0, 0, 2, -1, 1], dtype=torch.int32)
    buf = lora_shrink_ref(x, lora_a, indices, scale=0.5)
    assert torch.allclose(buf[indices < 0], torch.zeros(3, 8))
    expected = y.clone()
    expected[:, 20:36] += 0.5 * per_token(x, lora_a, lora_b, indices)
    lora_expand_ref(buf, lora_b, indices, y, offset=20)
    torch.testing.assert_close(y, expected)


ON_GPU = torch.cuda.is_available()
RUN_TRITON = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(RUN_TRITON, reason="the Triton test runs in this process")
def test_triton_kernels_in_interpreter():
    """``test_triton_kernels_equal_references`` in a fresh process under ``TRITON_INTERPRET=1``
    (read when triton is first imported; ``tests/test_kernels_triton.py`` does the same)."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [*command, "triton_kernels_equal"], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-4000:]


@pytest.mark.skipif(not RUN_TRITON, reason="CPU host: run by test_triton_kernels_in_interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if ON_GPU else torch.float16])
def test_triton_kernels_equal_references(dtype):
    """The Triton shrink and expand (called directly: the dispatch takes the references on the
    CPU) equal the references, a strided slice of the shrink's output expanded at an offset."""
    from mm_serve.kernels.triton_lora import lora_expand_triton, lora_shrink_triton

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(37, 200, generator=gen), torch.randn(37, 300, generator=gen)
    lora_a, lora_b = torch.randn(4, 48, 200, generator=gen), torch.randn(4, 96, 16, generator=gen)
    indices = torch.randint(-1, 4, (37,), generator=gen, dtype=torch.int32)
    device = "cuda" if ON_GPU else "cpu"
    x, y, lora_a, lora_b = (t.to(device, dtype) for t in (x, y, lora_a, lora_b))
    indices = indices.to(device)
    buf = lora_shrink_triton(x, lora_a, indices, 0.5)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {}
    torch.testing.assert_close(buf, lora_shrink_ref(x, lora_a, indices, 0.5), **tol)
    got, ref = y.clone(), y.clone()
    lora_expand_triton(buf[:, 16:32], lora_b, indices, got, offset=100)
    lora_expand_ref(buf[:, 16:32], lora_b, indices, ref, offset=100)
    torch.testing.assert_close(got, ref, **tol)


# ---- adapters ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    """(checkpoint, {adapter name: folder}, the model's LoRA targets on meta)."""
    from transformers import AutoConfig

    from mm_serve.models.loader import get_model_class

    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=3)
    adapters = build_lora_adapters(path, tmp_path_factory.mktemp("adapters"))
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        targets = ModelLoRATargets.of(get_model_class(config)(config))
    return path, adapters, targets


def test_peft_adapter_maps_onto_fused_layers(qwen2_vl):
    _, adapters, targets = qwen2_vl
    adapter = load_adapter(LoRARequest("qv", 1, adapters["qv-r8"]), targets, 64)
    qkv = adapter.layers["model.layers.0.self_attn.qkv_proj"]
    assert [None if pair is None else pair[1].shape for pair in qkv] == [(64, 8), None, (32, 8)]
    assert adapter.rank == 8 and not adapter.targets_tower
    tensors = load_file(os.path.join(adapters["qv-r8"], "adapter_model.safetensors"))
    key = "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight"
    torch.testing.assert_close(qkv[0][1], tensors[key] * 16 / 8)  # lora_alpha / r folded in
    tower = load_adapter(LoRARequest("t", 2, adapters["tower-r64"]), targets, 64)
    assert tower.targets_tower and "visual.merger.mlp.2" in tower.layers
    gate_up = tower.layers["model.layers.1.mlp.gate_up_proj"]
    assert [pair[1].shape for pair in gate_up] == [(128, 64), (128, 64)]
    rslora = load_adapter(LoRARequest("r", 3, adapters["lm-r16"]), targets, 64)
    key = "base_model.model.model.language_model.layers.0.mlp.down_proj.lora_B.weight"
    tensors = load_file(os.path.join(adapters["lm-r16"], "adapter_model.safetensors"))
    b = rslora.layers["model.layers.0.mlp.down_proj"][0][1]
    torch.testing.assert_close(b, tensors[key] * 8 / 16**0.5)  # use_rslora: alpha / sqrt(r)


def edited_copy(src: str, dst: str, config: dict | None = None, tensors=None) -> str:
    """A copy of the adapter folder ``src`` at ``dst`` with config keys and tensors replaced."""
    shutil.copytree(src, dst)
    if config:
        file = os.path.join(dst, "adapter_config.json")
        with open(file) as f:
            merged = json.load(f) | config
        with open(file, "w") as f:
            json.dump(merged, f)
    if tensors is not None:
        weights = os.path.join(dst, "adapter_model.safetensors")
        save_file(tensors(load_file(weights)), weights)
    return dst


def narrowed(tensors: dict) -> dict:
    """The A matrices of a model with a narrower hidden size."""
    return {k: v[:, :16].contiguous() if "lora_A" in k else v for k, v in tensors.items()}


def with_lm_head(tensors: dict) -> dict:
    """The tensors plus a pair on ``lm_head`` (vocabulary 407), which we do not serve."""
    head = "base_model.model.lm_head.lora_"
    return tensors | {head + "A.weight": torch.zeros(8, 64), head + "B.weight": torch.zeros(407, 8)}


def bad_adapters(adapters: dict[str, str], folder) -> dict[str, tuple[str, str]]:
    """name -> (adapter folder, words the error must contain)."""
    src = adapters["qv-r8"]
    return {
        "rank": (adapters["tower-r64"], "above max_lora_rank=16"),
        "missing": (str(folder / "nowhere"), "Cannot read"),
        "dora": (edited_copy(src, folder / "dora", {"use_dora": True}), "DoRA"),
        "prompt_tuning": (edited_copy(src, folder / "pt", {"peft_type": "PROMPT_TUNING"}), "LoRA"),
        "other_base": (edited_copy(src, folder / "narrow", tensors=narrowed), "another base model"),
        "lm_head": (edited_copy(src, folder / "head", tensors=with_lm_head), "cannot serve"),
    }


def test_bad_adapters_are_refused(qwen2_vl, tmp_path):
    _, adapters, targets = qwen2_vl
    for name, (folder, words) in bad_adapters(adapters, tmp_path).items():
        with pytest.raises(LoRAAdapterError, match=words):
            load_adapter(LoRARequest(name, 1, folder), targets, 16)


def test_engine_refuses_bad_adapter_and_keeps_serving(qwen2_vl, tmp_path):
    path, adapters, _ = qwen2_vl
    llm = LLM(path, enable_lora=True, max_lora_rank=16, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    good = LoRARequest("qv", 1, adapters["qv-r8"])

    def tokens() -> list[int]:
        return llm.generate("a", params, use_tqdm=False, lora_request=good)[0].outputs[0].token_ids

    served = tokens()
    assert len(served) == 4
    for name, (folder, _) in bad_adapters(adapters, tmp_path).items():
        with pytest.raises(LoRAAdapterError):
            llm.generate(
                ["a", "b"],
                params,
                use_tqdm=False,
                lora_request=[good, LoRARequest(name, 2, folder)],
            )
        assert_llm_idle(llm)
    with pytest.raises(LoRAAdapterError, match="already the adapter"):
        llm.generate(
            "a", params, use_tqdm=False, lora_request=LoRARequest("x", 1, adapters["lm-r16"])
        )
    assert tokens() == served  # still served, the same
    llm.shutdown()
    base_only = LLM(path, max_num_batched_tokens=64)
    with pytest.raises(LoRAAdapterError, match="enable_lora"):
        base_only.generate("a", params, use_tqdm=False, lora_request=good)
    base_only.shutdown()


def test_lora_config_limits():
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3
    for bad in ({"max_loras": 0}, {"max_lora_rank": 12}, {"max_loras": 4, "max_cpu_loras": 2}):
        with pytest.raises(ValueError):
            LoRAConfig(**bad)


# ---- scheduler and prefix cache ------------------------------------------------------------


def lora_request(req_id: str, lora_int_id: int | None, first_token: int = 0) -> Request:
    lora = None if lora_int_id is None else LoRARequest(f"a{lora_int_id}", lora_int_id, "/x")
    tokens = list(range(first_token, first_token + 6))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    return Request(req_id, tokens, params, lora_request=lora)


def test_scheduler_runs_at_most_max_loras_adapters_per_step():
    config = SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8, max_model_len=64)
    scheduler = Scheduler(config, CacheConfig(block_size=4), 64, max_loras=2)
    for req_id, lora in (("a", 1), ("b", 2), ("c", 3), ("d", None), ("e", 1)):
        scheduler.add_request(lora_request(req_id, lora))
    out = scheduler.schedule()
    # "c" (a third adapter) waits; the base request and adapter 1's second request run.
    assert list(out.num_scheduled_tokens) == ["a", "b", "d", "e"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    scheduler.finish_requests(["a", "b", "e"], scheduler.requests["a"].status.FINISHED_ABORTED)
    assert list(scheduler.schedule().num_scheduled_tokens) == ["d", "c"]
    off = Scheduler(config, CacheConfig(block_size=4), 64)
    with pytest.raises(ValueError, match="enable_lora"):
        off.add_request(lora_request("a", 1))


def test_adapter_enters_the_first_block_hash():
    keys = [block_extra_keys(lora_request("r", lora), 0, 4) for lora in (None, 1, 2)]
    assert len(set(keys)) == 3
    assert block_extra_keys(lora_request("r", 1), 4, 8) == ()  # the chain carries it on
