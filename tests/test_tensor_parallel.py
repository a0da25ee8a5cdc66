"""Tensor parallelism: sharded loading, start-up checks, and the multiprocess executor's
outputs against one rank and against HF.

The ranks run on the CPU (gloo). With ``MM_SERVE_TP_TEST_DEVICE=cuda`` the executor's tests run
the same models on two GPUs (NCCL), float32 as on the CPU; they skip with fewer GPUs."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from mm_serve import LLM, SamplingParams
from mm_serve.config import EngineArgs
from mm_serve.config.parallel import ParallelConfig, check_tensor_parallel
from mm_serve.distributed import parallel_state
from mm_serve.engine.executor import WorkerDiedError
from mm_serve.models.loader import load_model, safetensors_files
from tests.fixtures.leaks import assert_llm_idle
from tests.fixtures.server import RemoteServer, assert_group_gone, image_question, noise_png_url
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

DEVICE = os.environ.get("MM_SERVE_TP_TEST_DEVICE", "cpu")
two_ranks = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="needs two GPUs"
)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_its_shard(family, rank, llama_path, qwen2_path, monkeypatch) -> None:
    """Rank ``rank`` of 2, built without a process group, holds its slice of each tensor."""
    path = {"llama": llama_path, "qwen2": qwen2_path}[family]
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelState(rank, 2))
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


def test_executor_backend_defaults_and_checks() -> None:
    """One rank runs in the engine core's process unless asked otherwise; "uni" is one rank."""
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert ParallelConfig(distributed_executor_backend="mp").distributed_executor_backend == "mp"
    with pytest.raises(ValueError, match="uni executor backend runs one rank"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="executor backend is one of"):
        ParallelConfig(distributed_executor_backend="threads")


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


# ---- the multiprocess executor: TP=2 against TP=1 and HF --------------------------------

MAX_NEW_TOKENS = 12
LOGPROB_TOL = 1e-4
# Chunked prefill (20 tokens a step), preemption (32 blocks of 4) and prefix caching.
ENGINE_ARGS = {"device": DEVICE, "max_num_batched_tokens": 20, "block_size": 4, "num_kv_blocks": 32}


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(5)
    prefix = [rng.randrange(vocab_size) for _ in range(13)]  # shared: prefix-cache hits
    lengths = [3, 40, 8, 21, 17, 30]
    return [prefix + [rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def _assert_same(tp2: list, tp1: list) -> None:
    """Same greedy tokens; the same top-5 logprobs within ``LOGPROB_TOL``."""
    for a, b in zip(tp2, tp1, strict=True):
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
            top_a = sorted(step_a.items(), key=lambda kv: kv[1].rank)[:5]
            for token_id, logprob in top_a:
                assert abs(logprob.logprob - step_b[token_id].logprob) < LOGPROB_TOL


# (family, how the engine runs): in this process; or in the engine core process (the served
# API's), with async scheduling (two steps sent before the first one's tokens are read); or
# one rank in one worker process ("mp" at size 1), also with async scheduling.
ASYNC = {"async_scheduling": True}
MODES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "llama-engine-process-async": ("llama", {"multiprocess": True, **ASYNC}),
    "qwen2-one-worker-async": (
        "qwen2",
        {"tensor_parallel_size": 1, "distributed_executor_backend": "mp", **ASYNC},
    ),
}


@pytest.fixture(scope="module")
def tp1_outputs():
    """``get(path)``: the prompts and one rank's outputs on them (in order, then reversed),
    generated once per checkpoint for all the modes of ``test_tp2_matches_tp1_and_hf``."""
    outputs: dict[str, tuple[list, list]] = {}

    def get(path: str) -> tuple[list, list]:
        if path not in outputs:
            tp1 = LLM(path, **ENGINE_ARGS)
            prompts = _prompts(tp1.config.model.vocab_size)
            outputs[path] = (prompts, _generate(tp1, prompts) + _generate(tp1, prompts[::-1]))
            tp1.shutdown()
        return outputs[path]

    return get


@two_ranks
@pytest.mark.parametrize("mode", MODES)
def test_tp2_matches_tp1_and_hf(mode, llama_path, qwen2_path, hf_reference, tp1_outputs) -> None:
    """Two CPU ranks (gloo), or one in a worker process: greedy tokens equal those of one rank
    in this process and HF's, with chunked prefill, preemption and prefix caching; the second
    batch is served from the prefix cache."""
    family, extra = MODES[mode]
    path = {"llama": llama_path, "qwen2": qwen2_path}[family]
    prompts, expected = tp1_outputs(path)
    llm = LLM(path, **{"tensor_parallel_size": 2, **ENGINE_ARGS, **extra})
    assert llm.config.parallel.distributed_executor_backend == "mp"
    try:
        got = _generate(llm, prompts)
        hits = llm.get_stats().prefix_cache_hits
        got += _generate(llm, prompts[::-1])
        stats = llm.get_stats()
        assert stats.prefix_cache_hits > hits and stats.num_preemptions > 0
        assert_llm_idle(llm)
    finally:
        llm.shutdown()
    _assert_same(got, expected)
    reference = hf_reference(path)
    for prompt, completion in zip(prompts, got, strict=False):
        assert completion.token_ids == reference.greedy(prompt, MAX_NEW_TOKENS)[0]


QWEN_TAG = "<|vision_start|><|image_pad|><|vision_end|>"
VLM_PLACEHOLDER = {"qwen2_vl": QWEN_TAG, "llava": "<image>", "qwen3_vl": QWEN_TAG}


@two_ranks
@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "qwen3_vl"])
def test_tp2_vlm_matches_tp1(family, tmp_path) -> None:
    """The vision tower is replicated on each rank (the Qwen-VL ones each encode a share of
    the images, ``worker.encoder_dp``), the LM sharded: the same greedy tokens and top-5
    logprobs as one rank (which ``test_vlm_vs_hf`` checks against HF)."""
    path = build_tiny_vlm_checkpoint(tmp_path, family=family, seed=3)
    tag = VLM_PLACEHOLDER[family]
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in
              ((64, 96), (120, 40))]  # fmt: skip
    prompts = [
        {"prompt": f"{tag}Describe the image.", "multi_modal_data": {"image": images[:1]}},
        {"prompt": f"Compare {tag} with {tag}.", "multi_modal_data": {"image": images}},
        {"prompt": "Only text here.", "multi_modal_data": {"image": []}},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)
    args = {"device": DEVICE, "max_model_len": 512, "num_kv_blocks": 128}
    tp1 = LLM(path, **args)
    expected = [o.outputs[0] for o in tp1.generate(prompts, params, use_tqdm=False)]
    tp1.shutdown()
    llm = LLM(path, tensor_parallel_size=2, **args)
    try:
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_llm_idle(llm)
    finally:
        llm.shutdown()
    _assert_same(got, expected)


@two_ranks
def test_a_killed_worker_fails_the_engine_fast(llama_path) -> None:
    """SIGKILL to rank 1: the next step raises ``WorkerDiedError`` within seconds, and no
    worker process is left."""
    llm = LLM(llama_path, tensor_parallel_size=2, device=DEVICE)
    executor = llm.engine_core.model_runner
    processes = list(executor._workers.processes)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    try:
        llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
        os.kill(processes[1].pid, signal.SIGKILL)
        processes[1].join(10)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker 1"):
            llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
        assert time.monotonic() - start < 10
        assert not any(process.is_alive() for process in processes)
    finally:
        llm.shutdown()


@two_ranks
def test_served_tp2_answers_as_tp1_and_dies_with_a_worker(vlm_path, vlm_llm) -> None:
    """``mm-serve serve --tensor-parallel-size 2``: a greedy chat answer about an image equals
    the offline one-rank engine's; after SIGKILL to a worker the next request gets a 503, the
    server exits with code 1 and leaves no process behind."""
    messages = image_question(noise_png_url(3, 60, 90))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    (expected,) = vlm_llm.chat(messages, params, use_tqdm=False)
    server = RemoteServer(
        vlm_path,
        ["--tensor-parallel-size", "2", "--device", DEVICE, "--max-model-len", "512",
         "--num-kv-blocks", "64"],
    )  # fmt: skip
    try:
        body = {"model": vlm_path, "messages": messages, "temperature": 0, "max_tokens": 8}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert reply.json()["choices"][0]["message"]["content"] == expected.outputs[0].text
        (engine_core,) = _spawned_children(server.proc.pid)
        workers = _spawned_children(engine_core)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        time.sleep(1)
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 503
        assert server.proc.wait(30) == 1
        assert_group_gone(server.proc.pid)
    finally:
        server.stop()


def _spawned_children(pid: int) -> list[int]:
    """The children of ``pid`` started by multiprocessing's "spawn" (read from /proc)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    children = sorted(int(c) for task in tasks for c in (task / "children").read_text().split())
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
