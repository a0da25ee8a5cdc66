"""The fused mixture-of-experts MLP (``kernels/moe.py``, ``kernels/triton_moe.py``): the block
alignment by hand, the torch path and the Triton grouped GEMM against the plain per-expert
loop in float32 (``fused_experts_loop_ref``), with the routing weights on the outputs and on
the inputs (Llama 4), the routing, and Llama 4's MoE block against HF's ``Llama4TextMoe``.

The Triton kernel runs compiled on a CUDA host in bf16, fp16 and fp32; on a CPU host it runs in
Triton's interpreter in fp32 at small shapes, in a child pytest of this file started with
``TRITON_INTERPRET=1`` (which must be set before triton is imported). Every case routes some
experts no token and gives others more slots than a block holds.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from mm_serve.kernels import moe
from mm_serve.kernels.dispatch_moe import fused_experts

ON_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if ON_GPU else "cpu"
# (tokens, hidden, intermediate, experts, top_k): decode-like (one slot per expert at most)
# and prefill-like (64-row blocks, experts with several blocks).
SHAPES = [(3, 64, 32, 8, 2), (150, 64, 48, 6, 2), (40, 96, 40, 16, 4)]
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def moe_inputs(shape, dtype, device="cpu", seed=0):
    """``(x, w13, w2, topk_weights, topk_ids)`` for ``shape``: routing by ``topk_softmax`` on
    random logits that favour the first experts (so some get many slots, some none)."""
    tokens, hidden, inter, experts, top_k = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    bias = torch.linspace(3.0, -3.0, experts)  # the last experts are rarely chosen
    logits = torch.randn(tokens, experts, generator=gen) + bias
    weights, ids = moe.topk_softmax(logits, top_k, renormalize=True)
    to = lambda t: t.to(device, dtype)  # noqa: E731
    return to(x), to(w13), to(w2), weights.to(device), ids.to(device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def test_align_block_size_by_hand():
    """Slots of experts 2, 0, 2, 3, 2 (expert 1 unused) in blocks of 2: expert 0's one slot and
    a pad, expert 2's three slots and a pad, expert 3's one and a pad; the unused blocks have
    expert -1 and pads hold the slot count (5)."""
    topk_ids = torch.tensor([[2], [0], [2], [3], [2]], dtype=torch.int32)
    blocks = moe.moe_align_block_size(topk_ids, block_size=2, num_experts=4)
    pad = 5
    # room for 5 slots and 4 experts' padding of 1: 9 rows, 5 blocks
    assert blocks.sorted_token_ids.tolist() == [1, pad, 0, 2, 4, pad, 3, pad, pad, pad]
    assert blocks.expert_ids.tolist() == [0, 2, 2, 3, -1]
    assert blocks.num_tokens_post_padded.tolist() == [8]
    assert blocks.sorted_token_ids.dtype == blocks.expert_ids.dtype == torch.int32


def test_align_block_size_two_choices_per_token():
    """With ``top_k = 2`` a slot is ``token * 2 + choice``; every slot appears once, within a
    block of its expert."""
    topk_ids = torch.tensor([[1, 0], [0, 1], [1, 3]], dtype=torch.int32)
    blocks = moe.moe_align_block_size(topk_ids, block_size=4, num_experts=4)
    rows = blocks.sorted_token_ids.view(-1, 4)
    assert rows[0].tolist() == [1, 2, 6, 6] and rows[1].tolist() == [0, 3, 4, 6]
    assert rows[2].tolist() == [5, 6, 6, 6]
    assert blocks.expert_ids.tolist()[:3] == [0, 1, 3]
    assert int(blocks.num_tokens_post_padded) == 12


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("on_input", [False, True], ids=["weighted_output", "weighted_input"])
def test_torch_path_matches_the_loop(shape, block_size, on_input):
    x, w13, w2, weights, ids = moe_inputs(shape, torch.float32)
    out = moe.fused_experts_ref(x, w13, w2, weights, ids, on_input, block_size)
    ref = moe.fused_experts_loop_ref(x, w13, w2, weights, ids, on_input)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert relative_error(out, ref) <= TOLERANCE[torch.float32]


def test_torch_path_in_bfloat16():
    x, w13, w2, weights, ids = moe_inputs(SHAPES[1], torch.bfloat16)
    out = moe.fused_experts_ref(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, moe.fused_experts_loop_ref(x, w13, w2, weights, ids)) <= 2e-2


def test_topk_sigmoid_is_llama4s_router():
    """The top logits' experts, their sigmoids as weights (HF ``Llama4Router``'s scores)."""
    logits = torch.tensor([[0.5, -1.0, 2.0], [-3.0, -2.0, -4.0]])
    weights, ids = moe.topk_sigmoid(logits, 1)
    assert ids.tolist() == [[2], [1]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[2.0], [-2.0]])))


def test_topk_softmax_renormalizes_and_orders():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.5, 0.0, 0.0]])
    weights, ids = moe.topk_softmax(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [1, 0]] and ids.dtype == torch.int32
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    raw, _ = moe.topk_softmax(logits, 2, renormalize=False)
    torch.testing.assert_close(raw, torch.softmax(logits, -1).topk(2).values)


def test_dispatch_runs_the_torch_path_on_cpu():
    """The CPU runs ``fused_experts_ref``; a step of no tokens gives no rows."""
    x, w13, w2, weights, ids = moe_inputs(SHAPES[0], torch.float32)
    assert torch.equal(
        fused_experts(x, w13, w2, weights, ids), moe.fused_experts_ref(x, w13, w2, weights, ids)
    )
    none = fused_experts(x[:0], w13, w2, weights[:0], ids[:0])
    assert none.shape == (0, x.shape[1])


@pytest.mark.skipif(not HAS_TRITON or ON_GPU or INTERPRET, reason="runs the kernels here")
def test_kernel_in_triton_interpreter() -> None:
    """This file's kernel tests in a fresh process under ``TRITON_INTERPRET=1``."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "kernel_matches"]
    result = subprocess.run([*cmd, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{4 * len(SHAPES)} passed" in result.stdout, result.stdout[-3000:]


@pytest.mark.skipif(not (ON_GPU or INTERPRET), reason="needs a GPU or Triton's interpreter")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float32]
)
@pytest.mark.parametrize("config", ["default", "small"])
@pytest.mark.parametrize("on_input", [False, True], ids=["weighted_output", "weighted_input"])
def test_triton_kernel_matches_the_loop(shape, dtype, config, on_input):
    from mm_serve.kernels import triton_moe

    x, w13, w2, weights, ids = moe_inputs(shape, dtype, DEVICE)
    tiles = None
    if config == "small":  # 16-row blocks, tiles narrower than N and K: every edge masked
        tiles = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4}
    out = triton_moe.fused_experts_triton(x, w13, w2, weights, ids, on_input, tiles)
    ref = moe.fused_experts_loop_ref(x, w13, w2, weights, ids, on_input)
    assert out.shape == x.shape and out.dtype == dtype
    assert relative_error(out, ref) <= TOLERANCE[dtype]


@torch.inference_mode()
@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_block_matches_hf(top_k):
    """``SharedExpertMoeBlock`` loaded from HF's ``Llama4TextMoe`` (experts stacked ``[E, H,
    2 I]`` and ``[E, I, H]``, the router, the shared expert's three projections) gives its
    output: sigmoid routing, each token scaled before its experts, the shared expert added."""
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    from mm_serve.models.layers.fused_moe import SharedExpertMoeBlock

    config = Llama4TextConfig(
        hidden_size=64, intermediate_size=24, num_local_experts=8, num_experts_per_tok=top_k
    )
    torch.manual_seed(top_k)
    hf = Llama4TextMoe(config).eval()
    for param in hf.parameters():
        param.normal_(0.0, 0.2)
    ours = SharedExpertMoeBlock(64, 8, top_k, 24)
    for name, tensor in hf.state_dict().items():
        if name.startswith("experts."):
            ours.experts.weight_loader(getattr(ours.experts, name[len("experts.") :]), tensor)
        elif name == "router.weight":
            ours.router.weight.copy_(tensor)
        elif name.startswith("shared_expert.down_proj"):
            ours.shared_expert.down_proj.weight_loader(ours.shared_expert.down_proj.weight, tensor)
        else:
            merged = ours.shared_expert.gate_up_proj
            merged.weight_loader(merged.weight, tensor, int("up_proj" in name))
    x = torch.randn(37, 64)
    expected, _ = hf(x)
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
