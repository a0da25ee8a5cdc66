"""Qwen3-VL-MoE against HF transformers on a tiny checkpoint written by ``save_pretrained``
(``tests/fixtures/qwen3_vl_checkpoint.py``: 8 experts of width 24, 2 per token, in layers 0
and 2; layer 1 dense).

The pieces: the checkpoint's stacked expert tensors as transformers writes them; the router
picks HF's experts with HF's weights on the same hidden states; a sparse block and the whole
LM's MoE layers equal HF's; the hub's transposed layout loads to the same parameters; each
tensor-parallel rank holds its slice of every expert. The engine: greedy tokens (and top
log-probs) equal HF's ``generate`` for a batch mixing a text-only prompt, a photograph and
several odd-sized images, whole and chunked (a budget smaller than every image), through the
prefix cache, and with two tensor-parallel ranks (gloo) as with one; for Qwen3-VL's video
batch, chunked.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from mm_serve.distributed import parallel_state
from mm_serve.models.layers.fused_moe import FusedMoE, SparseMoeBlock
from mm_serve.models.loader import safetensors_files
from tests.fixtures import family_checks as checks
from tests.fixtures.images import generated, mixed_batch, photo
from tests.fixtures.qwen_video_cases import (
    assert_matches_hf,
    clip_fixture,
    mixed_video_batch,
    qwen3_hf_greedy,
)

TAG = "<|vision_start|><|image_pad|><|vision_end|>"
SMALL_BUDGET = 5  # tokens per step: below every test image's 6 or more image tokens
LAYER = "model.language_model.layers.{}.mlp."
EXPERTS, HIDDEN, MOE_INTER = 8, 64, 24

path, reference = checks.checkpoint_fixtures("qwen3_vl_moe", seed=3, nested_images=False)
clip = clip_fixture()


def cases():
    return mixed_batch(
        describe=f"{TAG}Describe the image.",
        compare=f"Compare {TAG} with {TAG} and {TAG} please.",
        several=[generated(301, 87, 1), generated(23, 45, 2), photo("astronaut.png")],
        what=f"{TAG}What is here?",
    )


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(safetensors_files(path)[0], framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def hf_hidden_states(reference, layer: int, seed: int = 0, tokens: int = 40) -> torch.Tensor:
    """Hidden states ``[tokens, hidden]`` as the MLP of ``layer`` sees them: random rows through
    HF's post-attention norm of that layer."""
    hf_layer = reference.model.model.language_model.layers[layer]
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return hf_layer.post_attention_layernorm(x)


def test_checkpoint_has_transformers_stacked_experts(path):
    """transformers 5 saves its own layout: ``gate_up_proj [E, 2 I, H]``, ``down_proj [E, H,
    I]`` and the router ``[E, H]`` in the sparse layers, a gated MLP in the dense one."""
    tensors = checkpoint_tensors(path)
    for layer in (0, 2):
        prefix = LAYER.format(layer)
        assert tensors[prefix + "experts.gate_up_proj"].shape == (EXPERTS, 2 * MOE_INTER, HIDDEN)
        assert tensors[prefix + "experts.down_proj"].shape == (EXPERTS, HIDDEN, MOE_INTER)
        assert tensors[prefix + "gate.weight"].shape == (EXPERTS, HIDDEN)
    assert LAYER.format(1) + "gate_proj.weight" in tensors
    assert not any(name.startswith(LAYER.format(1) + "experts") for name in tensors)


@torch.inference_mode()
@pytest.mark.parametrize("layer", [0, 2])
def test_router_picks_hfs_experts(path, reference, layer):
    """On the same hidden states, our router's top-2 experts (in order) are HF's
    ``Qwen3VLMoeTextTopKRouter``'s, with its renormalised weights."""
    model = loaded_model(path)
    x = hf_hidden_states(reference, layer)
    _, hf_weights, hf_ids = reference.model.model.language_model.layers[layer].mlp.gate(x)
    weights, ids = model.model.layers[layer].mlp.gate(x)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=1e-6, rtol=0)
    assert len(set(ids.flatten().tolist())) > 4  # the routing spreads over the experts


@torch.inference_mode()
def test_sparse_block_matches_hf(path, reference):
    """Our loaded ``SparseMoeBlock`` (router, fused experts) equals HF's MoE block."""
    model = loaded_model(path)
    block = model.model.layers[2].mlp
    assert isinstance(block, SparseMoeBlock)
    x = hf_hidden_states(reference, 2, seed=1)
    expected = reference.model.model.language_model.layers[2].mlp(x[None])[0]
    torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)


def stacked(rank: int, tp_size: int, monkeypatch) -> FusedMoE:
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelState(rank, tp_size))
    return FusedMoE(EXPERTS, HIDDEN, MOE_INTER)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_its_slice_of_every_expert(path, rank, monkeypatch):
    """With two ranks, rank ``rank`` holds rows ``[12 rank, 12 rank + 12)`` of each expert's
    gate and of its up projection, and those columns of its down projection; the hub's
    transposed tensors load to the same parameters."""
    tensors = checkpoint_tensors(path)
    gate_up = tensors[LAYER.format(0) + "experts.gate_up_proj"]
    down = tensors[LAYER.format(0) + "experts.down_proj"]
    experts = stacked(rank, 2, monkeypatch)
    experts.weight_loader(experts.gate_up_proj, gate_up)
    experts.weight_loader(experts.down_proj, down)
    part = slice(12 * rank, 12 * rank + 12)
    gate, up = gate_up[:, :MOE_INTER], gate_up[:, MOE_INTER:]
    assert torch.equal(experts.gate_up_proj, torch.cat([gate[:, part], up[:, part]], dim=1))
    assert torch.equal(experts.down_proj, down[:, :, part])
    hub = stacked(rank, 2, monkeypatch)
    hub.weight_loader(hub.gate_up_proj, gate_up.transpose(1, 2).contiguous())
    hub.weight_loader(hub.down_proj, down.transpose(1, 2).contiguous())
    assert torch.equal(hub.gate_up_proj, experts.gate_up_proj)
    assert torch.equal(hub.down_proj, experts.down_proj)
    with pytest.raises(ValueError, match="expected"):
        hub.weight_loader(hub.down_proj, down[:, :, :-1])


def loaded_model(path: str):
    """Our model on the checkpoint, float32, one rank (the engine's loader)."""
    from mm_serve.config import EngineArgs
    from mm_serve.models.loader import load_model

    config = EngineArgs(model=path, device="cpu").create_engine_config().model
    return load_model(config, "cpu")


@checks.whole_and_chunked(budget=SMALL_BUDGET)
def test_greedy_matches_hf(path, reference, engine_args):
    """HF's tokens for the mixed batch; chunked, every image is cut across steps (each has
    more tokens than a step's budget)."""
    processor = checks.image_processor(path)
    sizes = [processor.preprocess(image).num_tokens for _, images in cases() for image in images]
    assert min(sizes) > SMALL_BUDGET
    with checks.running_llm(path, **engine_args) as llm:
        checks.assert_matches_hf(llm, reference, cases())


def test_videos_match_hf(path, reference, clip):
    """Qwen3-VL's video batch (a clip by path and as bytes beside an image, decoded frames, a
    real clip), chunked by 8 tokens a step: HF's greedy tokens and top log-probs."""
    with checks.running_llm(path, max_num_batched_tokens=8, block_size=4) as llm:
        assert_matches_hf(llm, reference, mixed_video_batch(clip), qwen3_hf_greedy)


def test_prefix_cache_hits_match_hf(path, reference):
    """The same image prompt twice hits the prefix cache; another image behind the same text
    does not; all three equal HF's."""
    case = (f"{TAG}Describe the image.", [photo("grace_hopper.jpg")])
    other = (case[0], [photo("coffee.png")])
    args = dict(enable_prefix_caching=True, block_size=4, max_num_batched_tokens=16)
    with checks.running_llm(path, **args) as llm:
        checks.assert_prefix_cache_hits(llm, reference, case, case, other)


def test_tensor_parallel_matches_hf(path, reference):
    """Two CPU ranks (gloo), each with half of every expert: HF's greedy tokens and top
    log-probs for the mixed batch, chunked."""
    args = dict(tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4)
    with checks.running_llm(path, **args) as llm:
        assert llm.config.parallel.tensor_parallel_size == 2
        checks.assert_matches_hf(llm, reference, cases())


def test_published_architecture_has_hfs_parameters(tmp_path):
    """``bench``'s weightless Qwen3-VL-30B-A3B folder: 128 experts of width 768, 8 per token,
    in each of 48 layers; our model (on the meta device) has HF's 31.07 billion parameters;
    the engine splits it over 2 ranks but not over 5 (32 heads, 768-wide experts)."""
    from transformers import Qwen3VLMoeForConditionalGeneration as HFModel

    from mm_serve.config.parallel import check_tensor_parallel
    from mm_serve.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
    from tests.fixtures.checkpoints import write_architecture

    config = checks.hf_config(write_architecture("qwen3-vl-30b-a3b", tmp_path))
    text = config.text_config
    moe = (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size)
    assert moe == (128, 8, 768) and text.num_hidden_layers == 48
    counts = checks.meta_parameter_counts(config, HFModel, Qwen3VLMoeForConditionalGeneration)
    assert counts[0] == counts[1] == 31_070_754_032
    check_tensor_parallel(config, 2)
    # Heads and the dense width that 5 ranks divide: only the experts' width fails.
    text.num_attention_heads, text.num_key_value_heads, text.intermediate_size = 40, 5, 6000
    with pytest.raises(ValueError, match="moe_intermediate_size=768"):
        check_tensor_parallel(config, 5)
