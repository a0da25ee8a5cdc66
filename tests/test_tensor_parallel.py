"""Tensor parallelism on the CPU (gloo): sharded loading, start-up checks, and the
multiprocess executor's outputs against one rank and against HF."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from mm_serve import distributed
from mm_serve.config import EngineArgs, check_tensor_parallel
from mm_serve.models.loader import load_model, mapped_safetensors, safetensors_files


def test_mapped_safetensors_match_safe_open(qwen2_path) -> None:
    (file,) = safetensors_files(qwen2_path)
    mapped = dict(mapped_safetensors(file))
    with safe_open(file, framework="pt") as f:
        assert sorted(mapped) == sorted(f.keys())
        for name, tensor in mapped.items():
            assert torch.equal(tensor, f.get_tensor(name)), name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_its_shard(family, rank, llama_path, qwen2_path, monkeypatch) -> None:
    """Rank ``rank`` of 2, built without a process group, holds its slice of each tensor."""
    path = {"llama": llama_path, "qwen2": qwen2_path}[family]
    monkeypatch.setattr(distributed, "_TP", distributed.TensorParallelState(rank, 2))
    config = EngineArgs(model=path, device="cpu").create_engine_config().model
    model = load_model(config, "cpu")
    with safe_open(safetensors_files(path)[0], framework="pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    layer = model.model.layers[0]
    prefix = "model.layers.0."
    q, k = full[prefix + "self_attn.q_proj.weight"], full[prefix + "self_attn.k_proj.weight"]
    qkv = layer.self_attn.qkv_proj
    q_rows, kv_rows = qkv.q_size, qkv.kv_size
    assert torch.equal(qkv.weight[:q_rows], q[rank * q_rows : (rank + 1) * q_rows])
    assert torch.equal(
        qkv.weight[q_rows : q_rows + kv_rows], k[rank * kv_rows : (rank + 1) * kv_rows]
    )
    down = full[prefix + "mlp.down_proj.weight"]
    cols = down.shape[1] // 2
    assert torch.equal(layer.mlp.down_proj.weight, down[:, rank * cols : (rank + 1) * cols])
    embed = full["model.embed_tokens.weight"]
    shard = model.model.embed_tokens
    part = embed[shard.vocab_start : shard.vocab_end]
    assert torch.equal(shard.weight[: len(part)], part)
    assert shard.weight.shape[0] == -(-embed.shape[0] // 2)


def test_sizes_that_do_not_divide_the_model_fail_at_start_up(llama_path) -> None:
    """The tiny Llama: 4 heads, 2 KV heads, intermediate 128."""
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        EngineArgs(model=llama_path, device="cpu", tensor_parallel_size=3).create_engine_config()
    with pytest.raises(ValueError, match="at least 1"):
        EngineArgs(model=llama_path, device="cpu", tensor_parallel_size=0).create_engine_config()
    config = EngineArgs(model=llama_path, device="cpu").create_engine_config().model.hf_config
    check_tensor_parallel(config, 4)  # 2 KV heads, each replicated on 2 ranks
    config.intermediate_size = 130
    with pytest.raises(ValueError, match="intermediate_size=130"):
        check_tensor_parallel(config, 4)
