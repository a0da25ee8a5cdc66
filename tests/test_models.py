"""Our Llama/Qwen2 over a paged KV cache against HF transformers on the same tiny checkpoint.

The KV cache, block tables (shuffled, non-contiguous block ids) and slot mapping are built by
hand here, as the model runner would; unused cache slots hold NaN, so a read of a wrong slot
shows up as NaN logits.
"""

from __future__ import annotations

import os
import random
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from mm_serve.checkpoint.hub import ModelLoadError, resolve_model_path
from mm_serve.config import EngineArgs
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.models.interface import LanguageModel, VisionLanguageModel
from mm_serve.models.layers.rotary import get_rope, rope_params_from_config
from mm_serve.models.loader import get_model_class, load_model
from tests.fixtures.checkpoints import build_tiny_checkpoint

BLOCK_SIZE, NUM_BLOCKS = 4, 96
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
VARIANTS = {
    "llama": dict(family="llama"),
    "qwen2": dict(family="qwen2", seed=1),
    "llama-linear": dict(family="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-llama3": dict(family="llama", rope_scaling=LLAMA3_ROPE),
    "llama-dynamic": dict(family="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    # Biases on every projection, and head_dim != hidden / heads.
    "llama-bias-hd32": dict(family="llama", attention_bias=True, mlp_bias=True, head_dim=32),
}


class Setup:
    """One checkpoint loaded twice: through ``load_model`` (ours) and by HF transformers."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.config = EngineArgs(model=path, device="cpu").create_engine_config().model
        self.model = load_model(self.config, "cpu")
        self.hf = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.vocab = self.config.vocab_size

    @torch.inference_mode()
    def hf_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module", params=list(VARIANTS))
def setup(request, tmp_path_factory) -> Setup:
    return Setup(
        build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    )


class PagedBatcher:
    """Hand-made paged KV cache: allocates shuffled blocks and builds each step's metadata."""

    def __init__(self, setup: Setup, seed: int = 0) -> None:
        cfg = setup.config
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.full(shape, float("nan")) for _ in range(cfg.num_layers)]
        setup.model.bind_kv_cache(self.kv_caches)
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]):
        """``chunks``: (request, its next token ids). Returns input_ids, positions, metadata."""
        ids, positions, slots, seq_lens, starts, tables = [], [], [], [], [0], []
        for req, tokens in chunks:
            start = self.num_computed.get(req, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(req, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            slots += [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
            seq_lens.append(end)
            starts.append(starts[-1] + len(tokens))
            tables.append(table)
            self.num_computed[req] = end
        width = max(map(len, tables))
        metadata = AttentionMetadata(
            num_reqs=len(chunks),
            num_tokens=len(ids),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(ids), torch.tensor(positions), metadata


def _tokens(setup: Setup, length: int, seed: int) -> list[int]:
    return torch.randint(
        0, setup.vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@torch.inference_mode()
def _run_steps(setup: Setup, sequences: dict[str, list[int]], steps: list[dict[str, int]]) -> None:
    """Feed each request's tokens in the given per-step amounts; every step's logits (for every
    token, prefill or decode) must equal HF's full-sequence logits at those positions."""
    batcher = PagedBatcher(setup)
    reference = {req: setup.hf_logits(tokens) for req, tokens in sequences.items()}
    fed = dict.fromkeys(sequences, 0)
    for step in steps:
        chunks = [(req, sequences[req][fed[req] : fed[req] + n]) for req, n in step.items()]
        input_ids, positions, metadata = batcher.step(chunks)
        logits = setup.model.compute_logits(setup.model(input_ids, positions, metadata))
        assert logits.dtype == torch.float32 and logits.shape == (len(input_ids), setup.vocab)
        expected = torch.cat([reference[req][fed[req] : fed[req] + n] for req, n in step.items()])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
        for req, n in step.items():
            fed[req] += n


def test_text_model_is_a_language_model_and_no_vlm(setup: Setup) -> None:
    assert isinstance(setup.model, LanguageModel)
    assert not isinstance(setup.model, VisionLanguageModel)


def test_batch_of_full_prefills(setup: Setup) -> None:
    lengths = {"a": 5, "b": 13, "c": 1, "d": 300}  # 300: positions where rope scaling matters
    sequences = {r: _tokens(setup, n, i) for i, (r, n) in enumerate(lengths.items())}
    _run_steps(setup, sequences, [lengths])


def test_cached_prefix_then_chunk(setup: Setup) -> None:
    sequences = {"a": _tokens(setup, 30, 10), "b": _tokens(setup, 17, 11)}
    _run_steps(setup, sequences, [{"a": 11, "b": 8}, {"a": 19, "b": 9}])


def test_decodes_batched_with_a_prefill_chunk(setup: Setup) -> None:
    sequences = {r: _tokens(setup, 40, 20 + i) for i, r in enumerate("abc")}
    steps = [
        {"a": 7, "b": 10},  # two prefills
        {"a": 1, "b": 1, "c": 6},  # two decodes + the first chunk of c
        {"c": 9, "a": 1, "b": 1},  # a later chunk of c between decodes
        {"b": 1, "a": 1, "c": 1},  # all decode
    ]
    _run_steps(setup, sequences, steps)


@torch.inference_mode()
def test_no_kv_cache_runs_plain_causal_attention(setup: Setup) -> None:
    tokens = _tokens(setup, 21, 5)
    setup.model.bind_kv_cache([torch.empty(0)] * setup.config.num_layers)
    hidden = setup.model(torch.tensor(tokens), torch.arange(21), None)
    torch.testing.assert_close(
        setup.model.compute_logits(hidden), setup.hf_logits(tokens), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        LLAMA3_ROPE,
        {"rope_type": "dynamic", "factor": 2.0},
    ],
)
def test_rotary_table_matches_hf(rope_scaling: dict | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    def hf_config() -> LlamaConfig:
        kwargs = {"rope_scaling": dict(rope_scaling)} if rope_scaling else {}
        return LlamaConfig(
            hidden_size=64,
            num_attention_heads=4,
            max_position_embeddings=1024,
            rope_theta=5e5,
            **kwargs,
        )

    config = hf_config()
    rope = get_rope(16, config.max_position_embeddings, *rope_params_from_config(config))
    cos, sin = rope.cos_sin_cache.chunk(2, dim=-1)
    x = torch.empty(1, dtype=torch.float32)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(x, torch.arange(1024)[None])
    torch.testing.assert_close(cos[:1024], hf_cos[0, :, :8], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:1024], hf_sin[0, :, :8], atol=1e-6, rtol=0)
    if rope_scaling and rope_scaling["rope_type"] == "dynamic":
        assert rope.cos_sin_cache.shape == (2048, 16)
        # Beyond the window, position p gets what HF uses for a sequence that ends at p.
        for p in (1024, 1500, 2047):
            hf_cos, _ = LlamaRotaryEmbedding(hf_config())(x, torch.arange(p + 1)[None])
            torch.testing.assert_close(cos[p], hf_cos[0, p, :8], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama_ckpt"), "llama", seed=3)


def _model_config(path: str, dtype: str = "auto"):
    return EngineArgs(model=path, dtype=dtype, device="cpu").create_engine_config().model


def test_sharded_checkpoint_loads_identically(llama_ckpt: str, tmp_path) -> None:
    sharded = build_tiny_checkpoint(tmp_path / "sharded", "llama", seed=3, num_shards=3)
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) == 3
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    one = dict(load_model(_model_config(llama_ckpt), "cpu").named_parameters())
    three = dict(load_model(_model_config(sharded), "cpu").named_parameters())
    assert one.keys() == three.keys()
    for name, param in one.items():
        assert torch.equal(param, three[name]), name


def test_missing_weights_are_named(llama_ckpt: str, tmp_path) -> None:
    path = tmp_path / "broken"
    path.mkdir()
    for name in os.listdir(llama_ckpt):
        if name != "model.safetensors":
            shutil.copy(os.path.join(llama_ckpt, name), path / name)
    tensors = load_file(os.path.join(llama_ckpt, "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as info:
        load_model(_model_config(str(path)), "cpu")
    message = str(info.value)
    assert "model.layers.1.mlp.down_proj.weight" in message
    assert "model.layers.0.self_attn.qkv_proj.weight" in message  # k missing -> qkv incomplete
    assert "model.layers.0.mlp" not in message


def test_missing_config_or_weights(llama_ckpt: str, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        _model_config(str(tmp_path))
    shutil.copy(os.path.join(llama_ckpt, "config.json"), tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(_model_config(str(tmp_path)), "cpu")


def test_unsupported_architecture_names_supported_ones() -> None:
    with pytest.raises(ValueError) as info:
        get_model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"]))
    assert "GPT2LMHeadModel" in str(info.value)
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        assert name in str(info.value)


def test_hub_id_offline_gives_clear_error(monkeypatch, tmp_path) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE") as info:
        resolve_model_path("some-org/some-model")
    assert "some-org/some-model" in str(info.value)
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    assert resolve_model_path(str(tmp_path)) == os.path.abspath(tmp_path)


@torch.inference_mode()
def test_bfloat16_load(llama_ckpt: str) -> None:
    model = load_model(_model_config(llama_ckpt, "bfloat16"), "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    hidden = model(torch.arange(12), torch.arange(12), None)
    assert hidden.dtype == torch.bfloat16
    assert model.compute_logits(hidden).isfinite().all()


def test_tensor_parallel_weight_loaders_take_this_ranks_shard(monkeypatch) -> None:
    """Rank 1 of 2, built without a process group: each loader must pick rank 1's slice."""
    from mm_serve.distributed import parallel_state as distributed
    from mm_serve.models.layers.embedding import VocabParallelEmbedding
    from mm_serve.models.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    monkeypatch.setattr(distributed, "_TP", distributed.TensorParallelState(rank=1, size=2))
    qkv = QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=2, bias=True)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard_id, w in zip("qkv", (q, k, v), strict=True):
        qkv.weight_loader(qkv.weight, w, shard_id)
    assert torch.equal(qkv.weight.data, torch.cat([q[4:], k[2:], v[2:]]))
    gate_up = MergedColumnParallelLinear(8, [6, 6])
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    gate_up.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight_loader(gate_up.weight, up, 1)
    assert torch.equal(gate_up.weight.data, torch.cat([gate[3:], up[3:]]))
    row = RowParallelLinear(6, 8, bias=True)
    w, b = torch.randn(8, 6), torch.randn(8)
    row.weight_loader(row.weight, w)
    row.weight_loader(row.bias, b)
    assert torch.equal(row.weight.data, w[:, 3:]) and torch.equal(row.bias.data, b)
    embed = VocabParallelEmbedding(7, 4)  # shards of 4 rows: rank 1 has 3 rows + 1 padding
    table = torch.randn(7, 4)
    embed.weight_loader(embed.weight, table)
    assert torch.equal(embed.weight.data, torch.cat([table[4:], torch.zeros(1, 4)]))
