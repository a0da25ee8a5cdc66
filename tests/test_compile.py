"""torch.compile of the LM forward (compilation level 2, ``worker.compile``).

On CPU: Dynamo traces the tiny models' forward into one graph (no graph break) whose only
attention is the opaque ``mm_serve::attention`` op, once per layer, and that graph, run by the
engine for every step (prefill chunks, decodes, preemption, prefix hits, Qwen2-VL's images and
M-RoPE), gives HF's greedy tokens. Inductor itself runs on the GPU (the CUDA tests in
``test_cuda_graphs.py`` run at the default level 2); here the traced graph runs as traced.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from test_llm_vs_hf import check_against_hf, random_prompts
from test_vlm_vs_hf import qwen2_vl_cases

from mm_serve import LLM, SamplingParams
from mm_serve.config import EngineArgs
from mm_serve.entrypoints.cli_flags import add_engine_args
from mm_serve.worker.compile import CompiledForward, compile_cache_dir


class RecordingBackend:
    """A Dynamo backend that keeps each traced graph and runs it as traced."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def attention_calls(self) -> list[int]:
        """The number of ``mm_serve::attention`` calls in each traced graph."""
        ops = (torch.ops.mm_serve.attention, torch.ops.mm_serve.attention.default)
        return [sum(n.target in ops for n in gm.graph.nodes) for gm in self.graphs]


def compile_engine(llm: LLM, tmp_path) -> RecordingBackend:
    backend = RecordingBackend()
    runner = llm.engine_core.model_runner
    runner.lm_forward = CompiledForward(runner.model, tmp_path / "cache", backend=backend)
    return backend


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_llama_matches_hf(llama_path, hf_reference, tmp_path):
    engine_args = {"max_num_batched_tokens": 20, "block_size": 4, "num_kv_blocks": 40}
    llm = LLM(llama_path, device="cpu", max_num_seqs=8, **engine_args)
    backend = compile_engine(llm, tmp_path)
    vocab = llm.config.model.vocab_size
    prefix = random_prompts(vocab, [9], seed=7)[0]  # shared: prefix-cache hits
    for seed, lengths in enumerate([[3, 70, 5], [8, 47, 12, 15, 16], [1, 2, 30]]):
        check_against_hf(
            llm, hf_reference(llama_path), random_prompts(vocab, lengths, seed, prefix)
        )
    layers = llm.config.model.text_config.num_hidden_layers
    # One graph for every token count > 1, one specialised to a single token.
    assert backend.attention_calls() == [layers, layers]
    assert llm.engine_core.scheduler.num_preemptions > 0
    assert llm.get_stats().prefix_cache_hits > 0


def test_compiled_qwen2_vl_matches_hf(tmp_path):
    path, reference, cases, prompts = qwen2_vl_cases(tmp_path)
    llm = LLM(path, device="cpu", max_num_seqs=16, max_num_batched_tokens=8, block_size=4)
    backend = compile_engine(llm, tmp_path)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    for (text, images), output in zip(cases, outputs, strict=True):
        assert output.outputs[0].token_ids == reference.greedy(text, images)[1]
    assert backend.graphs and all(n > 0 for n in backend.attention_calls())


def test_compilation_level(llama_path):
    assert EngineArgs(model=llama_path).compilation_level == 2
    cpu = EngineArgs(model=llama_path, device="cpu").create_engine_config()
    assert cpu.compilation.level == 0  # CPU is always eager
    with pytest.raises(ValueError, match="compilation_level must be 0, 1 or 2"):
        EngineArgs(model=llama_path, compilation_level=3).create_engine_config()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--compilation-level", "1"]).compilation_level == 1
    assert parser.parse_args([]).compilation_level == 2


def test_compile_cache_dir_keys(llama_path, qwen2_path, monkeypatch, tmp_path):
    monkeypatch.setenv("MM_SERVE_CACHE_DIR", str(tmp_path))
    configs = [
        EngineArgs(model=path, device="cpu", dtype=dtype).create_engine_config()
        for path, dtype in [
            (llama_path, "float32"),
            (llama_path, "float32"),
            (qwen2_path, "float32"),
            (llama_path, "bfloat16"),
        ]
    ]
    dirs = [compile_cache_dir(c) for c in configs]
    assert dirs[0] == dirs[1] and len(set(dirs)) == 3
    assert all(d.parent == tmp_path / "torch_compile" for d in dirs)


def test_two_compiled_engines_in_one_process(llama_path, qwen2_path, hf_reference, tmp_path):
    """Each compiled graph's attention ops reach its own model's layers, whichever engine
    registered its layers last."""
    llms = [LLM(path, device="cpu") for path in (llama_path, qwen2_path)]
    for llm in llms:
        compile_engine(llm, tmp_path)
    for path, llm in zip((llama_path, qwen2_path), llms, strict=True):
        prompts = random_prompts(llm.config.model.vocab_size, [5, 40], seed=3)
        check_against_hf(llm, hf_reference(path), prompts)


def test_engines_built_one_after_another_each_compile(llama_path, qwen2_path, tmp_path):
    """More compiled engines in one process than Dynamo's recompile limit (8), of two model
    classes in turn: each traces its own forward, none fails the fullgraph compile."""
    assert torch._dynamo.config.recompile_limit <= 8
    params = SamplingParams(temperature=0.0, max_tokens=1)  # one prefill step, one graph
    for i in range(10):
        llm = LLM((llama_path, qwen2_path)[i % 2], device="cpu")
        backend = compile_engine(llm, tmp_path)
        llm.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
        assert len(backend.graphs) == 1
