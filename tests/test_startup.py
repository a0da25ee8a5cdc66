"""Start-up: the warm-up request leaves nothing behind (EngineCore.reset, AsyncLLM.warm_up),
the server logs each phase and says ready only once warm, and the CPU KV pool is sized from
the model and committed only as blocks are written."""

from __future__ import annotations

import asyncio
import base64
import re
import time
from pathlib import Path

import httpx
import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.config import EngineArgs
from mm_serve.frontend.async_llm import AsyncLLM
from mm_serve.messages.stats import EngineStats
from mm_serve.preprocess.pool import warm_up_image
from mm_serve.worker import kv_cache
from tests.fixtures.server import RemoteServer, assert_group_gone, metric
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "samples" / "demo_vlm" / "example.png"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=0)


def chat(image: bytes, question: str = "Describe the image.") -> list[dict]:
    image_part = {"type": "image", "image": image}
    return [{"role": "user", "content": [image_part, {"type": "text", "text": question}]}]


def rss_mib() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reset_forgets_caches_and_counters(checkpoint, async_scheduling):
    llm = LLM(checkpoint, async_scheduling=async_scheduling, multiprocess=False)
    core = llm.engine_core
    messages = chat(EXAMPLE.read_bytes())
    first = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    again = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    stats = core.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_encoder_cache_entries == 1
    assert core.model_runner.encoder_cache

    core.reset()
    assert core.get_stats() == EngineStats()
    runner = core.model_runner
    assert not runner.encoder_cache and not runner.requests and runner.input_batch.num_reqs == 0
    after = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0  # nothing left to hit
    assert after.outputs[0].token_ids == first.outputs[0].token_ids
    assert core.get_stats().encoder_cache_queries == 1

    pending = llm.input_processor.process("Some text.").result()
    (request,) = llm.input_processor.make_requests("busy", pending, GREEDY)
    core.add_request(request)
    with pytest.raises(RuntimeError, match="unfinished"):
        core.reset()
    core.abort_requests(["busy"])
    llm.shutdown()


async def _warm_up_scenario(checkpoint: str) -> dict:
    finished = []
    llm = await AsyncLLM.create(EngineArgs(checkpoint), on_request_finished=finished.append)
    try:
        pool = llm.input_processor.mm_processor.pool
        started = len(pool.worker_pids()) == pool.num_workers  # before any image came
        await llm.warm_up()
        result = {
            "started": started,
            "stats": await llm.get_stats(),
            "kv": await llm.engine_core.get_kv_cache_info(),
            "finished": list(finished),
        }
        prompt = await llm.apply_chat_template(chat(EXAMPLE.read_bytes()))
        processed = await llm.process(prompt)
        outputs = [out async for out in llm.generate(processed, GREEDY, "user")]
        result["user_cached_tokens"] = outputs[-1].num_cached_tokens
        result["user_stats"] = await llm.get_stats()
        result["finished_after_user"] = len(finished)
        result["hops"] = await _count_tokenizer_hops(llm)
        return result
    finally:
        llm.shutdown()


async def _count_tokenizer_hops(llm: AsyncLLM) -> tuple[int, int]:
    """Calls into the tokenizer thread of ``process_chat``: with an image the processor cache
    holds, and with a new one (which the pool preprocesses meanwhile)."""
    calls = []
    in_thread = llm._in_tokenizer_thread

    async def counted(fn, *args, **kwargs):
        calls.append(fn)
        return await in_thread(fn, *args, **kwargs)

    llm._in_tokenizer_thread = counted
    await llm.process_chat(chat(EXAMPLE.read_bytes()), cache_salt="hops")
    cached = len(calls)
    await llm.process_chat(chat(warm_up_image(96)))
    return cached, len(calls) - cached


def test_warm_up_leaves_nothing_behind(checkpoint):
    result = asyncio.run(_warm_up_scenario(checkpoint))
    assert result["started"]
    # The engine core forgot the warm-up: no counts, no cache entries, every block free.
    stats = result["stats"]
    assert stats.prefix_cache_queries == 0 and stats.encoder_cache_queries == 0
    assert stats.num_encoder_cache_entries == 0 and stats.encoder_tokens_computed == 0
    assert result["kv"].num_free_blocks == result["kv"].num_blocks
    # The processor cache keeps its image under a fresh uuid: one lookup, a miss.
    assert (stats.processor_cache_queries, stats.processor_cache_hits) == (1, 0)
    assert result["finished"] == []  # no metrics for it
    assert result["user_cached_tokens"] == 0
    assert result["user_stats"].encoder_cache_queries == 1
    # Render, tokenize and submit the images in one call; expand in a second one only when
    # an image had to wait for the pool.
    assert result["hops"][0] == 1 and result["hops"][1] <= 2
    assert result["finished_after_user"] == 1


def test_server_logs_each_phase_and_is_ready_only_once_warm(checkpoint, tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        server = RemoteServer(checkpoint, startup_timeout_s=180, stderr=log)
    url, port = server.url, server.port
    with server:
        log_text = log_path.read_text()
        assert "Warmed up in " in log_text  # before /health answered
        deadline = time.monotonic() + 10  # "Ready at" is logged once uvicorn listens
        while "Ready at" not in log_text and time.monotonic() < deadline:
            time.sleep(0.1)
            log_text = log_path.read_text()
        phases = [
            r"Starting \d+ preprocessing workers",
            r"Loading weights of ",
            r"KV cache: \d+ blocks",
            r"Warming up",
            r"Warmed up in ",
            rf"Ready at http://127\.0\.0\.1:{port}",
        ]
        positions = [re.search(p, log_text) for p in phases]
        assert all(positions), log_text
        assert [m.start() for m in positions[1:]] == sorted(m.start() for m in positions[1:])
        image = base64.b64encode(EXAMPLE.read_bytes()).decode()
        image_part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}
        body = {"messages": [{"role": "user", "content": [image_part]}], "max_tokens": 3}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert metric(metrics, "mm_serve_request_success_total") == 1  # not the warm-up
        assert metric(metrics, "mm_serve_time_to_first_token_seconds_count") == 1
        # SIGTERM to the server alone: it must take its engine core and workers with it.
        server.proc.terminate()
        server.proc.wait(30)
        assert_group_gone(server.proc.pid)


def test_cpu_kv_pool_is_sized_from_the_model_and_committed_on_write(checkpoint, monkeypatch):
    args = EngineArgs(checkpoint, max_model_len=256, max_num_seqs=4, device="cpu")
    config = args.create_engine_config()
    block_bytes = kv_cache.kv_block_bytes(config)
    model = config.model
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4  # K+V, fp32
    assert block_bytes == per_token * config.cache.block_size
    # max_num_seqs x max_model_len: 4 x 256 tokens = 64 blocks of 16, far below 2 GiB.
    assert kv_cache.determine_num_kv_blocks(config, None) == 64
    # Half the available memory caps it too.
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: 2 * 40 * block_bytes)
    assert kv_cache.determine_num_kv_blocks(config, None) == 40
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: 2 * 10 * block_bytes)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        kv_cache.determine_num_kv_blocks(config, None)

    # A 512 MiB pool costs (almost) no resident memory until its blocks are written.
    num_blocks = (512 << 20) // block_bytes
    before = rss_mib()
    caches = kv_cache.allocate_kv_caches(config, num_blocks)
    assert rss_mib() - before < 32
    assert all(c.shape[1] == num_blocks and not c.any() for c in caches)
    caches[0][:, : num_blocks // 2] = 1.0  # half of one layer's blocks: ~1/2 of its bytes
    grown = rss_mib() - before
    layer_mib = caches[0].numel() * caches[0].element_size() / 2**20
    assert 0.4 * layer_mib < grown < 0.6 * layer_mib + 32
    assert caches[0].dtype == torch.float32 and caches[1].sum() == 0
