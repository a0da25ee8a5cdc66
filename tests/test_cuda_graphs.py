"""CUDA graphs for decode-only steps and for mixed steps (by token count).

On CPU: the ladders, the padding/selection logic, and the whole graph path with the graph
replay stood in by an eager call over the same static buffers (so the buffer filling and the
padding rows and requests are checked against HF without a GPU). On CUDA: real graphs on equal
graphs off (``enforce_eager``) and equal HF, for text and Qwen2-VL (its tower graphed too),
with batch sizes between ladder steps, chunked prefill and preemption mixed in, and replays
counted.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from test_llm_vs_hf import check_against_hf, random_prompts
from test_vlm_vs_hf import HFVisionReference, prompt_cases, qwen2_vl_cases

from mm_serve import LLM, SamplingParams
from mm_serve.config import EngineArgs
from mm_serve.config.compilation import cuda_graph_batch_sizes, cuda_graph_num_tokens
from mm_serve.worker import cuda_graphs as cuda_graphs_module
from mm_serve.worker.cuda_graphs import (
    CudaGraphRunner,
    MixedCudaGraphRunner,
    is_decode_only,
    padded_batch_size,
)
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (CPU is always eager)"
)

# Batch sizes that fall between ladder steps (padded to 4, 8, 16) and one on a step.
BATCH_PROMPT_LENGTHS = {
    3: [3, 70, 5],
    5: [8, 47, 12, 15, 16],
    8: [17, 20, 24, 31, 33, 40, 55, 64],
    11: [3, 70, 5, 8, 47, 12, 15, 16, 17, 20, 24],
}


# ---- pure Python: ladder, padding, selection ----------------------------------------------


def test_batch_size_ladder():
    assert cuda_graph_batch_sizes(256)[:8] == (1, 2, 4, 8, 16, 24, 32, 40)
    assert cuda_graph_batch_sizes(256)[-1] == 256
    assert cuda_graph_batch_sizes(1000)[-1] == 512  # capped
    assert cuda_graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)  # the cap itself is captured
    assert cuda_graph_batch_sizes(3) == (1, 2, 3)
    assert cuda_graph_batch_sizes(1) == (1,)
    sizes = cuda_graph_batch_sizes(512)
    assert list(sizes) == sorted(set(sizes))


def test_num_tokens_ladder():
    sizes = cuda_graph_num_tokens(8192)
    assert sizes[:6] == (16, 32, 64, 96, 128, 192) and sizes[-1] == 2048  # capped
    assert list(sizes) == sorted(set(sizes))
    # Above 96 tokens a step pads by at most a third of its graph's size.
    assert all(b - a <= b / 3 for a, b in zip(sizes[:-1], sizes[1:], strict=True) if b > 96)
    assert cuda_graph_num_tokens(300)[-2:] == (256, 300)  # the budget itself is captured
    assert cuda_graph_num_tokens(8) == (8,)


def test_padded_batch_size():
    sizes = cuda_graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 4, 5, 9, 17, 63, 64)] == [
        1,
        2,
        4,
        4,
        8,
        16,
        24,
        64,
        64,
    ]
    assert padded_batch_size(65, sizes) is None


def test_is_decode_only():
    ones = np.ones(5, dtype=np.int64)
    assert is_decode_only(ones, has_images=False, has_prompt_logprobs=False)
    assert not is_decode_only(np.array([1, 2, 1]), has_images=False, has_prompt_logprobs=False)
    assert not is_decode_only(ones, has_images=True, has_prompt_logprobs=False)
    assert not is_decode_only(ones, has_images=False, has_prompt_logprobs=True)
    assert not is_decode_only(np.array([], dtype=np.int64), False, False)


def test_engine_args_enforce_eager(llama_path):
    assert EngineArgs(model=llama_path).enforce_eager is False
    config = EngineArgs(model=llama_path, max_num_seqs=40, device="cpu").create_engine_config()
    assert config.compilation.enforce_eager  # CPU never uses graphs
    assert config.compilation.cuda_graph_batch_sizes == (1, 2, 4, 8, 16, 24, 32, 40)
    llm = LLM(llama_path, device="cpu")
    assert llm.engine_core.model_runner.cuda_graphs is None


def test_cli_has_enforce_eager_flag():
    import argparse

    from mm_serve.entrypoints.cli_flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--enforce-eager"]).enforce_eager is True
    assert parser.parse_args([]).enforce_eager is False


class _EagerReplay:
    """Stands in for ``torch.cuda.CUDAGraph`` on CPU: replays by calling the model eagerly on
    the runner's static buffers (with host copies of them for the reference kernels)."""

    def __init__(self, runner: CudaGraphRunner, size: int) -> None:
        self.runner, self.size = runner, size

    def replay(self) -> None:
        r, n = self.runner, self.size
        metadata = r._metadata(n)  # what the graph was captured with, and host copies
        metadata.seq_lens_cpu = r.seq_lens[:n].tolist()
        positions = r._positions(n)
        r.outputs[n].copy_(r.model(r.input_ids[:n], positions, metadata))


def _install_eager_replays(llm: LLM) -> CudaGraphRunner:
    runner = llm.engine_core.model_runner
    config = llm.config
    graphs = CudaGraphRunner(
        runner.model,
        config.compilation.cuda_graph_batch_sizes,
        config.model.max_model_len,
        config.cache.block_size,
        runner.device,
    )
    hidden = config.model.text_config.hidden_size
    for size in graphs.sizes:
        graphs.graphs[size] = _EagerReplay(graphs, size)
        graphs.outputs[size] = torch.empty(size, hidden, dtype=config.model.dtype)
    runner.cuda_graphs = graphs
    return graphs


class _MixedEagerReplay:
    """``_EagerReplay`` for a mixed graph: the model on the static buffers of ``size`` tokens
    and the size's request capacity, padding requests and tokens included."""

    def __init__(self, runner: MixedCudaGraphRunner, size: int) -> None:
        self.runner, self.size = runner, size

    def replay(self) -> None:
        r, n = self.runner, self.size
        metadata = r._metadata(n)
        metadata.query_start_loc_cpu = metadata.query_start_loc.tolist()
        metadata.seq_lens_cpu = metadata.seq_lens.tolist()
        positions = r._positions(n)
        r.outputs[n].copy_(r.forward(positions, r.inputs_embeds[:n], metadata))


def _install_mixed_eager_replays(llm: LLM, sizes: tuple[int, ...]) -> MixedCudaGraphRunner:
    runner = llm.engine_core.model_runner
    config = llm.config
    hidden = config.model.text_config.hidden_size
    graphs = MixedCudaGraphRunner(
        runner.model,
        runner.lm_forward,
        sizes,
        config.model.max_model_len,
        config.cache.block_size,
        config.scheduler.max_num_seqs,
        runner.model.inputs_embeds_size,  # wider than hidden with Qwen3-VL's DeepStack
        config.model.dtype,
        runner.device,
    )
    for size in graphs.sizes:
        graphs.graphs[size] = _MixedEagerReplay(graphs, size)
        graphs.outputs[size] = torch.full((size, hidden), float("nan"), dtype=config.model.dtype)
    runner.mixed_graphs = graphs
    return graphs


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 20, "block_size": 4, "num_kv_blocks": 32}],
    ids=["default", "chunked_and_preemption"],
)
def test_padded_replay_path_matches_hf_on_cpu(llama_path, hf_reference, engine_args):
    llm = LLM(llama_path, device="cpu", max_num_seqs=16, **engine_args)
    graphs = _install_eager_replays(llm)
    # Small sizes: steps fall between them, pad requests and tokens, or run eagerly above.
    mixed = _install_mixed_eager_replays(llm, (8, 24, 40, 64, 128, 256))
    vocab = llm.config.model.vocab_size
    for batch, lengths in BATCH_PROMPT_LENGTHS.items():
        prompts = random_prompts(vocab, lengths, seed=batch)
        check_against_hf(llm, hf_reference(llama_path), prompts)
    assert graphs.num_replays > 0 and mixed.num_replays > 0
    if engine_args:
        assert llm.engine_core.scheduler.num_preemptions > 0


def test_padded_replay_path_qwen2_vl_on_cpu(tmp_path):
    """M-RoPE positions ``[3, B]`` through the static buffers, images mixed in (eager steps)."""
    path, reference, cases, prompts = qwen2_vl_cases(tmp_path)
    llm = LLM(path, device="cpu", max_num_seqs=16, max_num_batched_tokens=8, block_size=4)
    graphs = _install_eager_replays(llm)
    mixed = _install_mixed_eager_replays(llm, (4, 8))  # image chunks through the mixed path
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    for (text, images), output in zip(cases, outputs, strict=True):
        assert output.outputs[0].token_ids == reference.greedy(text, images)[1]
    assert graphs.num_replays > 0 and mixed.num_replays > 0


def test_padded_replay_path_qwen3_vl_on_cpu(tmp_path):
    """Qwen3-VL's wide ``inputs_embeds`` (DeepStack columns) through the mixed graphs' static
    buffer, image chunks included, and decode through the decode graphs."""
    path, reference, cases, prompts = qwen3_vl_cases(tmp_path)
    llm = LLM(path, device="cpu", max_num_seqs=16, max_num_batched_tokens=8, block_size=4)
    graphs = _install_eager_replays(llm)
    mixed = _install_mixed_eager_replays(llm, (4, 8))
    assert mixed.inputs_embeds.shape[1] == 3 * llm.config.model.text_config.hidden_size
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    for (text, images), output in zip(cases, outputs, strict=True):
        assert output.outputs[0].token_ids == reference.greedy(text, images)[1]
    assert graphs.num_replays > 0 and mixed.num_replays > 0


def qwen3_vl_cases(tmp_path):
    """The tiny Qwen3-VL checkpoint, its HF reference, Qwen2-VL's prompt cases (same
    placeholders) and the same cases as ``LLM.generate`` prompts."""
    path = build_tiny_vlm_checkpoint(tmp_path, family="qwen3_vl", seed=3)
    cases = prompt_cases("qwen2_vl")
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases]
    return path, HFVisionReference(path), cases, prompts


# ---- CUDA: real graphs --------------------------------------------------------------------


def _greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=20)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@needs_cuda
@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 24},
        {"max_num_batched_tokens": 20, "block_size": 4, "num_kv_blocks": 32},
    ],
    ids=["default", "chunked_prefill", "chunked_and_preemption"],
)
def test_graphs_match_eager_and_hf(model_path, hf_reference, engine_args):
    llm = LLM(model_path, multiprocess=False, **engine_args)
    eager = LLM(model_path, enforce_eager=True, multiprocess=False, **engine_args)
    graphs = llm.engine_core.model_runner.cuda_graphs
    mixed = llm.engine_core.model_runner.mixed_graphs
    assert graphs is not None and eager.engine_core.model_runner.cuda_graphs is None
    vocab = llm.config.model.vocab_size
    for batch, lengths in BATCH_PROMPT_LENGTHS.items():
        prompts = random_prompts(vocab, lengths, seed=batch)
        check_against_hf(llm, hf_reference(model_path), prompts)
        assert _greedy_tokens(llm, prompts) == _greedy_tokens(eager, prompts)
    assert graphs.num_replays > 0 and mixed.num_replays > 0
    assert llm.engine_core.model_runner.lm_forward.compile_seconds is not None  # level 2
    assert eager.engine_core.model_runner.mixed_graphs is None
    if "num_kv_blocks" in engine_args:
        assert llm.engine_core.scheduler.num_preemptions > 0


@needs_cuda
@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 8, "block_size": 4}])
@pytest.mark.parametrize("make_cases", [qwen2_vl_cases, qwen3_vl_cases], ids=["qwen2", "qwen3"])
def test_qwen_vl_graphs_match_eager_and_hf(tmp_path, monkeypatch, engine_args, make_cases):
    # The engine captures an image key once met ``CAPTURE_AFTER`` times, which these few
    # images never are: capture each when first met, so that the tower's graphs are compared.
    capture_first = functools.partial(cuda_graphs_module.EncoderCudaGraphs, capture_after=1)
    monkeypatch.setattr(cuda_graphs_module, "EncoderCudaGraphs", capture_first)
    path, reference, cases, prompts = make_cases(tmp_path)  # 5: padded to 8, then fewer
    params = SamplingParams(temperature=0.0, max_tokens=12)
    llm = LLM(path, multiprocess=False, **engine_args)
    eager = LLM(path, enforce_eager=True, multiprocess=False, **engine_args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    eager_outputs = eager.generate(prompts, params, use_tqdm=False)
    for (text, images), output, eager_output in zip(cases, outputs, eager_outputs, strict=True):
        _, ref_tokens, _ = reference.greedy(text, images)
        assert output.outputs[0].token_ids == ref_tokens
        assert eager_output.outputs[0].token_ids == ref_tokens
    runner = llm.engine_core.model_runner
    assert runner.cuda_graphs.num_replays > 0 and runner.mixed_graphs.num_replays > 0
    assert runner.model.tower_runner.num_replays > 0
    assert eager.engine_core.model_runner.model.tower_runner is None


@needs_cuda
def test_tower_graphs_are_captured_before_the_kv_cache_is_sized(tmp_path, monkeypatch):
    """The tower's graphs read no KV cache: they are captured when the cache is sized, so that
    the budget (free device memory, ``worker.kv_cache``) already counts their pool and their
    warm-up's activations. Captured after the cache, a 7B tower's chunks ran out of memory."""
    from mm_serve.worker import model_runner as runner_module

    path = qwen2_vl_cases(tmp_path)[0]
    config = EngineArgs(model=path).create_engine_config()
    runner = runner_module.ModelRunner(config)
    runner.load_model()
    sized_with = []

    def size(config, model):  # what the sizing sees: the graphs, and the memory they hold
        sized_with.append((len(model.tower_runner.graphs), torch.cuda.memory_reserved()))
        return 64

    monkeypatch.setattr(runner_module, "determine_num_kv_blocks", size)
    before = torch.cuda.memory_reserved()
    assert runner.determine_num_kv_blocks() == 64
    ((num_graphs, reserved),) = sized_with
    assert num_graphs > 0 and reserved > before
    runner.initialize_kv_cache(64)
    runner.capture_cuda_graphs()
    assert len(runner.model.tower_runner.graphs) == num_graphs  # not captured again
