"""Data parallelism: the replica router by hand, the replicas' counters and metrics, the
offline ``LLM`` over two replicas against one, and a served fleet of two on the CPU."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mm_serve import LLM, SamplingParams
from mm_serve.entrypoints.openai.metrics import ServerMetrics
from mm_serve.frontend.dp_client import DataParallelClientBase
from mm_serve.frontend.dp_router import ReplicaRouter
from mm_serve.frontend.exceptions import EngineDeadError
from mm_serve.messages.request import MultiModalFeature, PlaceholderRange, Request
from mm_serve.messages.stats import EngineStats, combine_stats
from tests.fixtures.server import RemoteServer, assert_group_gone, image_question, noise_png_url

BLOCK = 4


def request(tokens: list[int], images: dict[str, int] | None = None, salt=None) -> Request:
    """An engine request of ``tokens``; ``images``: mm_hash -> placeholder offset (2 tokens)."""
    features = [
        MultiModalFeature(mm_hash, PlaceholderRange(offset, 2))
        for mm_hash, offset in (images or {}).items()
    ]
    return Request("r", tokens, SamplingParams(), mm_features=features, cache_salt=salt)


def router(num_replicas: int = 2, max_imbalance: int = 2, capacity: int = 1000) -> ReplicaRouter:
    return ReplicaRouter(num_replicas, BLOCK, max_imbalance, capacity)


def test_an_idle_fleet_is_used_in_turn_and_load_wins() -> None:
    r = router(3)
    assert [r.route([request([i] * 9)], [0, 0, 0]) for i in range(4)] == [0, 1, 2, 0]
    assert r.route([request([7] * 9)], [2, 0, 1]) == 1


def test_a_known_image_goes_to_its_replica_unless_it_is_overloaded() -> None:
    r = router()
    first = r.route([request(list(range(10)), {"img-a": 2})], [0, 0])
    # Other text around the same image: no prefix in common, the image decides.
    again = request([50, 51, 52, 53, 54, 55, 1, 1, 56], {"img-a": 6})
    assert r.route([again], [0, 0]) == first
    assert r.route([again], [0, 0]) == first  # not the turn's replica
    busy = [0, 0]
    busy[first] = 2  # within max_imbalance
    assert r.route([again], busy) == first
    busy[first] = 3
    assert r.route([again], busy) == 1 - first
    busy[first], busy[1 - first] = 0, 1  # both hold it now: the load decides
    assert r.route([again], busy) == first


def test_a_long_shared_prefix_routes_a_short_one_does_not() -> None:
    r = router()
    shared = list(range(100, 116))  # 4 blocks
    owner = r.route([request([*shared, 1, 2])], [0, 0])
    assert r.route([request([*shared, 3, 4, 5])], [0, 0]) == owner
    assert r.route([request([*shared, 6])], [0, 0]) == owner
    # A one-block prefix of a 24-token prompt covers less than half: the turn decides.
    other = r.route([request([*shared[:4], *range(300, 320)])], [0, 0])
    assert r.route([request([*shared[:4], *range(400, 420)])], [0, 0]) == 1 - other


def test_prefix_keys_hold_images_and_salt() -> None:
    """Identical placeholder tokens of different images, or another cache_salt, are another
    prefix (as in the engine's block hashes)."""
    r = router()
    tokens = [9, 9, 0, 0, 9, 9, 9, 9, 9]
    owner = r.route([request(tokens, {"img-a": 2})], [0, 0])
    assert r.route([request(tokens, {"img-b": 2})], [0, 0]) == 1 - owner
    owner = r.route([request([5] * 12)], [0, 0])
    assert r.route([request([5] * 12, salt="tenant")], [0, 0]) == 1 - owner
    busy = [0, 0]
    busy[owner] = 1
    assert r.route([request([5] * 12)], busy) == owner


def test_pin_reset_and_capacity() -> None:
    r = router(capacity=3)
    r.pin([request([1] * 8, {"img-a": 0})], 1)  # 2 blocks and an image: 3 keys
    assert r.route([request([2] * 8, {"img-a": 4})], [0, 1]) == 1
    r.reset()
    assert r.route([request([3] * 8, {"img-a": 4})], [0, 1]) == 0
    r.route([request([4] * 16)], [0, 0])  # 4 new keys push the image out
    assert r.route([request([5] * 8, {"img-a": 4})], [1, 0]) == 1


class StubClient:
    """An engine core client's side that the data-parallel client uses, recorded."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.dead: EngineDeadError | None = None
        self.on_dead = None

    @property
    def num_in_flight(self) -> int:
        return len(self.added) - len(self.aborted)

    @property
    def is_dead(self) -> bool:
        return self.dead is not None

    def holds(self, request_id: str) -> bool:
        return request_id in self.added and request_id not in self.aborted

    def _add(self, requests: list[Request], sink) -> None:
        self.added += [r.request_id for r in requests]

    def _abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    def _mark_dead(self, error: EngineDeadError) -> None:
        if self.dead is None:
            self.dead = error
            if self.on_dead is not None:
                self.on_dead(error)


def test_requests_and_aborts_go_to_their_replica_and_a_death_takes_all_down() -> None:
    clients = [StubClient(), StubClient()]
    dp = DataParallelClientBase(clients)
    dp.router = router()
    for request_id, tokens in (("a", [1] * 9), ("b", [2] * 9), ("c", [3] * 9)):
        dp._add([Request(request_id, tokens, SamplingParams())], sink=None)
    dp._add([Request("d", [4] * 9, SamplingParams())], sink=None, replica=0)
    assert [c.added for c in clients] == [["a", "c", "d"], ["b"]]
    dp._abort(["b", "d", "gone"])
    assert [c.aborted for c in clients] == [["d"], ["b"]]
    assert dp.loads() == [2, 0]
    with pytest.raises(ValueError, match="not a replica"):
        dp._add([Request("e", [5] * 9, SamplingParams())], sink=None, replica=2)
    clients[1]._mark_dead(EngineDeadError("exited with code 1"))
    assert dp.is_dead and "replica 1" in str(clients[0].dead)
    with pytest.raises(EngineDeadError):
        dp._add([Request("f", [6] * 9, SamplingParams())], sink=None)


def test_combined_stats_and_per_replica_metrics() -> None:
    a = EngineStats(num_running_reqs=2, kv_cache_usage=0.5, encoder_cache_hits=3)
    a.iteration_tokens_counts, a.iteration_tokens_sum = [1] + [0] * 13, 1
    b = EngineStats(num_running_reqs=1, kv_cache_usage=0.25, processor_cache_hits=4)
    total = combine_stats([a, b])
    assert (total.num_running_reqs, total.kv_cache_usage, total.encoder_cache_hits) == (3, 0.375, 3)
    assert total.iteration_tokens_counts == a.iteration_tokens_counts
    a.processor_cache_hits = b.processor_cache_hits  # the front end's, on each replica's
    text = ServerMetrics().render([a, b]).decode()
    assert 'mm_serve_num_requests_running{engine="0"} 2.0' in text
    assert 'mm_serve_encoder_cache_hits_total{engine="1"} 0.0' in text
    assert 'mm_serve_iteration_tokens_total_bucket{engine="0",le="1.0"} 1.0' in text
    assert "mm_serve_processor_cache_hits_total 4.0" in text
    assert "mm_serve_num_requests_running 2.0" in ServerMetrics().render(a).decode()


OFFLINE_PROMPTS = [{"prompt_token_ids": [5, 6, 7 + i] * 7} for i in range(6)]
OFFLINE_PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def one_engine_tokens(llama_path) -> list[list[int]]:
    """One engine core's greedy tokens for ``OFFLINE_PROMPTS``."""
    one = LLM(llama_path, device="cpu", num_kv_blocks=64)
    outputs = one.generate(OFFLINE_PROMPTS, OFFLINE_PARAMS, use_tqdm=False)
    one.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("tp", [1, 2])
def test_offline_two_replicas_match_one(tp, llama_path, one_engine_tokens) -> None:
    """``LLM(data_parallel_size=2)``, each replica with ``tp`` tensor-parallel workers of its
    own: the same greedy tokens as one engine core, both replicas used, nothing left in
    either."""
    llm = LLM(
        llama_path, device="cpu", num_kv_blocks=64, data_parallel_size=2, tensor_parallel_size=tp
    )
    try:
        outputs = llm.generate(OFFLINE_PROMPTS, OFFLINE_PARAMS, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outputs]
        replicas = llm.engine_core.client.get_replica_stats()
        assert all(stats.prefix_cache_queries > 0 for stats in replicas)
        assert llm.get_stats().prefix_cache_queries == sum(s.prefix_cache_queries for s in replicas)
        assert all(stats.num_running_reqs == stats.num_waiting_reqs == 0 for stats in replicas)
    finally:
        llm.shutdown()
    assert got == one_engine_tokens


# ---- a served fleet of two ----------------------------------------------------------------


def replica_metrics(server: RemoteServer) -> dict[str, dict[str, float]]:
    """``/metrics``: sample name -> {engine label: value} of the per-replica samples."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "engine" in sample.labels and "le" not in sample.labels:
                values.setdefault(sample.name, {})[sample.labels["engine"]] = sample.value
    return values


def test_served_two_replicas_route_by_load_and_image(vlm_path, vlm_llm) -> None:
    """``mm-serve serve --data-parallel-size 2``: concurrent image chats all answer as one
    engine core does and use both replicas; an image asked about again (after other text, so
    that the prefix cache cannot serve it) goes to the replica that encoded it, whose
    encoder-cache hits rise while the other's do not. A replica killed makes the next request
    a 503 and the server exit with code 1, leaving no process."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    questions = [image_question(noise_png_url(seed, 112, 168)) for seed in range(6)]
    expected = [o.outputs[0].text for o in vlm_llm.chat(questions, params, use_tqdm=False)]
    args = ["--data-parallel-size", "2", "--max-model-len", "512", "--num-kv-blocks", "64"]
    server = RemoteServer(vlm_path, args)
    url = f"{server.url}/v1/chat/completions"

    def chat(messages: list[dict]) -> httpx.Response:
        body = {"model": vlm_path, "messages": messages, "temperature": 0, "max_tokens": 6}
        return httpx.post(url, json=body, timeout=120)

    try:
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(chat, questions))
        assert [r.json()["choices"][0]["message"]["content"] for r in replies] == expected
        used = replica_metrics(server)["mm_serve_encoder_cache_queries_total"]
        assert sorted(used) == ["0", "1"] and all(used[rank] >= 1 for rank in used), used
        streamed = ""
        body = {"model": vlm_path, "messages": questions[1], "temperature": 0, "max_tokens": 6}
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    streamed += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
        assert streamed == expected[1]
        before = replica_metrics(server)
        image = noise_png_url(99, 120, 150)
        assert chat(image_question(image)).status_code == 200
        middle = replica_metrics(server)
        queries = "mm_serve_encoder_cache_queries_total"
        (owner,) = [r for r in ("0", "1") if middle[queries][r] > before[queries][r]]
        other = "1" if owner == "0" else "0"
        image_part = image_question(image)[0]["content"][0]
        text_part = {"type": "text", "text": "Look again:"}
        messages = [{"role": "user", "content": [text_part, image_part]}]
        assert chat(messages).status_code == 200
        after = replica_metrics(server)
        hits = "mm_serve_encoder_cache_hits_total"
        assert after[hits][owner] == middle[hits][owner] + 1
        assert after[hits][other] == middle[hits][other]
        assert after[queries][other] == middle[queries][other]
        _kill_one_engine_core(server, chat, questions[0])
    finally:
        server.stop()


def _kill_one_engine_core(server: RemoteServer, chat, messages: list[dict]) -> None:
    """SIGKILL to replica 1's engine core: 503, exit code 1, no process left."""
    engine_cores = _children(server.proc.pid)
    assert len(engine_cores) == 2
    os.kill(engine_cores[1], signal.SIGKILL)
    time.sleep(1)
    assert chat(messages).status_code == 503
    assert server.proc.wait(30) == 1
    assert_group_gone(server.proc.pid)


def _children(pid: int) -> list[int]:
    """The spawned children of ``pid`` (multiprocessing's "spawn", read from /proc)."""
    from pathlib import Path

    tasks = Path(f"/proc/{pid}/task").iterdir()
    children = sorted(int(c) for task in tasks for c in (task / "children").read_text().split())
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.parametrize("size", [0])
def test_a_bad_size_fails_at_start_up(llama_path, size) -> None:
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(llama_path, device="cpu", data_parallel_size=size)
