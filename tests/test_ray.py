"""The ray backends on a local Ray cluster of two simulated nodes (``ray.cluster_utils``):
``mm-serve serve`` with its tensor-parallel workers, or its data-parallel engine cores, as Ray
actors placed one per node, answering as one engine core does; a node that stops makes the
server fail fast and leave no process. Skipped where Ray is not installed
(``pip install 'mm_serve[ray]'``; the test extra installs it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from mm_serve import SamplingParams
from tests.fixtures.server import RemoteServer, assert_group_gone, image_question, noise_png_url

pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

ARGS = ["--max-model-len", "512", "--num-kv-blocks", "64"]
STARTUP_TIMEOUT_S = 300  # Ray starts each actor's interpreter, which imports torch


@pytest.fixture(scope="module")
def cluster():
    """A head node and a worker node of one CPU each (Ray's logical CPUs): two actors of a
    CPU each can only be placed one per node. Servers find it through ``RAY_ADDRESS``."""
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ADDRESS", cluster.address)
        yield cluster
    cluster.shutdown()


def raylet_pids(cluster) -> set[int]:
    """The pid of each node's raylet, which starts the node's actor processes."""
    nodes = [cluster.head_node, *cluster.worker_nodes]
    return {node.all_processes["raylet"][0].process.pid for node in nodes}


def actor_processes(class_name: str) -> dict[int, int]:
    """Live Ray actor processes of ``class_name`` (their title is ``ray::CLASS...``): pid ->
    parent pid (its node's raylet)."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if cmdline.startswith(f"ray::{class_name}".encode()) and stat[0] not in "ZX":
            found[int(entry)] = int(stat[1])
    return found


def wait_gone(class_name: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while actor_processes(class_name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not actor_processes(class_name), f"{class_name} actors left behind"


def chat(server: RemoteServer, model: str, messages: list[dict]) -> httpx.Response:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 8}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize(
    ("flags", "actor"),
    [
        (["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"], "WorkerActor"),
        (["--data-parallel-size", "2", "--data-parallel-backend", "ray"], "EngineCoreActor"),
    ],
    ids=["tp2", "dp2"],
)
def test_ray_actors_one_per_node_answer_as_one_engine(
    flags, actor, cluster, vlm_path, vlm_llm
) -> None:
    """Two actors, one on each node, answer greedy image chats as the offline one-rank engine;
    then the worker node stops (its raylet and actors killed): the next request gets a 503,
    the server exits with code 1, and no server or actor process is left."""
    questions = [image_question(noise_png_url(seed, 90, 120)) for seed in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = [o.outputs[0].text for o in vlm_llm.chat(questions, params, use_tqdm=False)]
    server = RemoteServer(vlm_path, [*ARGS, *flags], startup_timeout_s=STARTUP_TIMEOUT_S)
    try:
        replies = [chat(server, vlm_path, messages) for messages in questions]
        assert [r.json()["choices"][0]["message"]["content"] for r in replies] == expected
        placed = actor_processes(actor)
        assert len(placed) == 2
        assert set(placed.values()) == raylet_pids(cluster)  # one per node
        (node,) = cluster.worker_nodes
        start = time.monotonic()
        cluster.remove_node(node)
        while (reply := chat(server, vlm_path, questions[0])).status_code == 200:
            assert time.monotonic() - start < 30, "the server did not notice the node"
        assert reply.status_code == 503
        assert server.proc.wait(30) == 1
        assert_group_gone(server.proc.pid)
        wait_gone(actor)
    finally:
        server.stop()
        if not cluster.worker_nodes:
            cluster.add_node(num_cpus=1)
