"""The torch profiler over a span of the engine's work (``LLM.start_profile`` /
``stop_profile``, ``MM_SERVE_TORCH_PROFILER_DIR``): in the engine's own process, in an engine
core process and in a worker process, each writing a Chrome trace of what it ran."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.utils.profiler import ACTIVITIES_ENV, DIR_ENV, TorchProfiler
from tests.fixtures.server import http_client

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def traces(folder: Path, name: str) -> list[dict]:
    """The trace events of each trace ``name`` wrote into ``folder``."""
    files = sorted(folder.glob(f"mm_serve-{name}-*.pt.trace.json.gz"))
    return [json.loads(gzip.open(f).read())["traceEvents"] for f in files]


def op_names(events: list[dict]) -> set[str]:
    return {e.get("name", "") for e in events}


def test_in_process_profile_records_the_steps(llama_path, tmp_path, monkeypatch):
    """One trace per start/stop, with the model's operators in it; a second start while it
    runs, and a stop while it does not, are errors that change nothing."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    llm = LLM(llama_path, multiprocess=False)
    try:
        with pytest.raises(RuntimeError, match="not running"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(RuntimeError, match="already running"):
            llm.start_profile()
        llm.generate(["The quick brown fox"], PARAMS, use_tqdm=False)
        llm.stop_profile()
        (events,) = traces(tmp_path, "engine-core")
        assert {"aten::mm", "aten::embedding"} <= op_names(events)
        assert llm.generate(["The quick brown fox"], PARAMS, use_tqdm=False)[0].outputs
        assert len(traces(tmp_path, "engine-core")) == 1  # nothing more once stopped
    finally:
        llm.shutdown()


def test_profiling_is_off_without_the_folder(llama_path, monkeypatch):
    monkeypatch.delenv(DIR_ENV, raising=False)
    llm = LLM(llama_path, multiprocess=False)
    try:
        with pytest.raises(RuntimeError, match=DIR_ENV):
            llm.start_profile()
        assert llm.generate(["Hello"], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_engine_core_and_worker_processes_write_their_traces(llama_path, tmp_path, monkeypatch):
    """With a worker process ("mp" at one rank) the engine core process writes its trace (the
    scheduler's side) and the worker its own (the model's operators); errors come back from
    the engine core process as RuntimeError and leave it serving."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    llm = LLM(llama_path, multiprocess=True, distributed_executor_backend="mp")
    try:
        with pytest.raises(RuntimeError, match="not running"):
            llm.stop_profile()
        llm.start_profile()
        llm.generate(["The quick brown fox"], PARAMS, use_tqdm=False)
        llm.stop_profile()
        (core,) = traces(tmp_path, "engine-core")
        (worker,) = traces(tmp_path, "rank0")
        assert "aten::mm" in op_names(worker) and "aten::mm" not in op_names(core)
        pids = {f.name.split("-")[-2] for f in tmp_path.iterdir()}
        assert str(os.getpid()) not in pids and len(pids) == 2
    finally:
        llm.shutdown()


def test_server_routes(llama_path, tmp_path, monkeypatch):
    """``POST /start_profile`` and ``/stop_profile`` of a server started with the folder set:
    a stop before a start, or a second start, is a 400 naming why; the trace holds the
    completion's forward passes (the model runs in the engine core process)."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    for client in http_client(llama_path, ["--max-model-len", "256"]):
        response = client.post("/stop_profile")
        assert response.status_code == 400
        assert "not running" in response.json()["error"]["message"]
        assert client.post("/start_profile").json() == {"status": "ok"}
        assert "already running" in client.post("/start_profile").json()["error"]["message"]
        body = {"model": llama_path, "prompt": "The quick brown fox", "max_tokens": 3}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/stop_profile").status_code == 200
    (core,) = traces(tmp_path, "engine-core")
    assert "aten::mm" in op_names(core)


def test_activities(tmp_path, monkeypatch):
    """ "cuda" alone records nothing in a process without a GPU; an unknown name is an error."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    profiler = TorchProfiler("test")
    monkeypatch.setenv(ACTIVITIES_ENV, "gpu")
    with pytest.raises(ValueError, match="gpu"):
        profiler.start()
    assert not profiler.running
    if not torch.cuda.is_available():
        monkeypatch.setenv(ACTIVITIES_ENV, "cuda")
        profiler.start()
        assert profiler.stop() is None and not list(tmp_path.iterdir())
