"""``bench throughput --peer vllm`` on CPU: the qwen2.5-vl-7b folder both engines load, the
workload written for the peer and read back, the peer subprocess's plumbing and its prompt-token
check, and the summary. vLLM itself is not here: a stand-in interpreter (``FAKE_PEER``) takes
the peer's command line, reads the workload with the real reader, and writes the peer's JSON
with the prompt tokens counted by the HF processor (as vLLM counts them) or a given number."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mm_serve.benchmarks import common, peer_vllm, roofline, throughput
from mm_serve.benchmarks.datasets import random_image, random_image_dataset
from mm_serve.benchmarks.peer_vllm import PeerRunner, PeerWorkload
from tests.fixtures.checkpoints import write_architecture

FAKE_PEER = """#!{python}
import json, os, sys

args = sys.argv[1:]
assert args[:2] == ["-m", "mm_serve.benchmarks.peer_vllm"], args
opts = dict(zip(args[2::2], args[3::2]))
from mm_serve.benchmarks.peer_vllm import read_workload

workload = read_workload(opts["--workload"])
with open(os.environ["FAKE_PEER_LOG"], "w") as f:
    json.dump({{"argv": args, "pythonpath": os.environ["PYTHONPATH"], "texts": workload.texts,
               "warmup_texts": workload.warmup_texts}}, f)
if "FAKE_PEER_EXIT" in os.environ:
    sys.exit(int(os.environ["FAKE_PEER_EXIT"]))
tokens = os.environ.get("FAKE_PEER_PROMPT_TOKENS")
if tokens is None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(opts["--model"])
    pairs = zip(workload.requests, workload.texts)
    tokens = sum(len(processor(text=[t], images=list(r.images))["input_ids"][0]) for r, t in pairs)
n, length = len(workload.requests), workload.requests[0].output_len
result = {{"vllm_version": "0.0-fake", "prompt_tokens": int(tokens), "output_tokens": n * length,
          "elapsed_s": 2.0, "num_requests": n, "requests_per_s": n / 2,
          "output_tokens_per_s": n * length / 2, "total_tokens_per_s": n * length}}
with open(opts["--output-json"], "w") as f:
    json.dump(result, f)
"""


@pytest.fixture
def fake_peer(tmp_path, monkeypatch) -> str:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PEER.format(python=sys.executable))
    path.chmod(0o755)
    monkeypatch.setenv("FAKE_PEER_LOG", str(tmp_path / "peer-log.json"))
    return str(path)


def _peer_log(tmp_path) -> dict:
    return json.loads((tmp_path / "peer-log.json").read_text())


def _workload(num_requests: int = 3, num_images: int = 2) -> PeerWorkload:
    dataset = random_image_dataset(num_requests + 2, 6, 5, (56, 84), num_images, seed=3)
    texts = common.prompt_texts(dataset, "qwen2_vl")
    return PeerWorkload(dataset[2:], texts[2:], dataset[:2], texts[:2])


def test_qwen2_5_vl_7b_folder_for_both_engines(tmp_path) -> None:
    """The published Qwen2.5-VL-7B-Instruct config: HF reads it (config and processor), our
    config resolution reads it, and both models built from it have 8,292,166,656 parameters
    (ours plus its padding)."""
    from transformers import AutoConfig, AutoProcessor
    from transformers import Qwen2_5_VLForConditionalGeneration as HFModel

    from mm_serve.config import EngineArgs
    from mm_serve.encoders.processors import get_image_processor
    from mm_serve.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration

    folder = write_architecture("qwen2.5-vl-7b", tmp_path)
    config = AutoConfig.from_pretrained(folder)
    t, v = config.text_config, config.vision_config
    assert config.model_type == "qwen2_5_vl" and config.tie_word_embeddings is False
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers) == (3584, 18944, 28)
    assert (t.num_attention_heads, t.num_key_value_heads, t.vocab_size) == (28, 4, 152064)
    assert t.rope_parameters["mrope_section"] == [16, 24, 24]
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads) == (32, 1280, 3420, 16)
    assert (v.window_size, v.fullatt_block_indexes, v.out_hidden_size) == (
        112,
        [7, 15, 23, 31],
        3584,
    )
    assert type(AutoProcessor.from_pretrained(folder)).__name__ == "Qwen2_5_VLProcessor"
    engine = EngineArgs(model=folder, device="cpu", load_format="dummy").create_engine_config()
    assert engine.model.hf_config.model_type == "qwen2_5_vl"
    assert engine.model.dtype == torch.bfloat16
    processor = get_image_processor(folder, config)
    image = random_image(np.random.default_rng(0), 1280, 720)
    assert processor.preprocess(image).num_tokens == 1196
    with torch.device("meta"):
        ours, theirs = Qwen2_5_VLForConditionalGeneration(config), HFModel(config)
    sizes = [sum(p.numel() for p in m.parameters()) for m in (ours, theirs)]
    # Ours adds the vision MLP's zero padding (Qwen2_5_VisionMLP: width 3,420 -> 3,456).
    padding = 32 * (3456 - 3420) * (3 * 1280 + 2)
    assert sizes == [8_292_166_656 + padding, 8_292_166_656]


def test_workload_round_trip(tmp_path) -> None:
    workload = _workload()
    peer_vllm.write_workload(str(tmp_path), workload)
    back = peer_vllm.read_workload(str(tmp_path))
    assert back.texts == workload.texts and back.warmup_texts == workload.warmup_texts
    assert "<|vision_start|><|image_pad|><|vision_end|>" * 2 in back.texts[0]
    pairs = list(zip(back.requests + back.warmup, workload.requests + workload.warmup, strict=True))
    assert len(pairs) == 5
    for read, written in pairs:
        assert (read.prompt, read.output_len) == (written.prompt, written.output_len)
        assert len(read.images) == len(written.images) == 2
        for a, b in zip(read.images, written.images, strict=True):
            assert (a.mode, a.size) == ("RGB", (56, 84))
            assert a.tobytes() == b.tobytes()


def _runner(fake_peer: str, tmp_path) -> PeerRunner:
    args = argparse.Namespace(
        peer_python=fake_peer, peer_pythonpath="/opt/vllm-site", peer_engine_args={"a": 1}, seed=7
    )
    return PeerRunner(args, "/models/x", "dummy", str(tmp_path), _workload())


def test_peer_run_and_its_prompt_token_check(fake_peer, tmp_path, monkeypatch) -> None:
    runner = _runner(fake_peer, tmp_path)
    monkeypatch.setenv("FAKE_PEER_PROMPT_TOKENS", "123")
    result = runner.run(prompt_tokens=123)
    assert result["prompt_tokens"] == 123 and result["output_tokens_per_s"] == 3 * 5 / 2
    log = _peer_log(tmp_path)
    opts = dict(zip(log["argv"][2::2], log["argv"][3::2], strict=True))
    assert opts["--model"] == "/models/x" and opts["--load-format"] == "dummy"
    assert opts["--seed"] == "7" and json.loads(opts["--engine-args"]) == {"a": 1}
    assert log["pythonpath"].split(os.pathsep)[0] == "/opt/vllm-site"
    assert log["texts"] == runner.workload.texts
    with pytest.raises(RuntimeError, match="vLLM counted 123 prompt tokens, mm_serve 124"):
        runner.run(prompt_tokens=124)
    monkeypatch.setenv("FAKE_PEER_EXIT", "3")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        runner.run(prompt_tokens=123)


def test_summary_prints_both_engines_ratio_and_roofline(tmp_path, monkeypatch, capsys) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(write_architecture("qwen2-vl-2b", tmp_path))
    monkeypatch.setattr(roofline, "measure_rates", lambda device: roofline.Rates(800e12, 3e12))
    run = {"num_requests": 256, "prompt_tokens": 256 * 306, "requests_per_s": 100.0}
    result = {
        "model": "qwen2-vl-2b", "load_format": "dummy", "dtype": "bfloat16", "device": "H100",
        "workload": {"num_prompts": 256, "input_len_words": 50, "output_len": 128,
                     "image_size": [448, 448], "num_images": 1},
        "hf": None,
        "mm_serve": {**run, "output_tokens_per_s": 25_000.0, "total_tokens_per_s": 85_000.0},
        "vllm": {**run, "output_tokens_per_s": 20_000.0, "total_tokens_per_s": 68_000.0,
                 "vllm_version": "0.33.0"},
    }  # fmt: skip
    result["roofline"] = roofline.bench_roofline(config, result, torch.device("cuda"))
    throughput._add_ratios(result)
    throughput.print_summary(result)
    lines = capsys.readouterr().out.splitlines()
    assert result["mm_serve_over_vllm"] == 1.25
    assert "mm_serve / vLLM (same requests): 1.250x" in lines
    (vllm_row,) = [line for line in lines if line.startswith("vLLM 0.33.0")]
    assert vllm_row.split()[-3:] == ["20000.0", "68000.0", str(256 * 306)]
    roof = result["roofline"]["output_tokens_per_s"]
    assert any(line.startswith(f"roofline: {roof:,.0f} out tok/s") for line in lines)
    assert f"  vllm: {100 * 20_000 / roof:.1f}% of the roofline" in lines
    assert f"  mm_serve: {100 * 25_000 / roof:.1f}% of the roofline" in lines


def test_bench_throughput_with_the_peer(fake_peer, tmp_path) -> None:
    """The whole ``--peer vllm`` path on the tiny architecture: the peer gets exactly our prompt
    texts, and our prompt-token count equals the HF processor's on them (what vLLM counts)."""
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", "bench", "throughput"]
    command += ["--model-arch", "tiny-qwen2-vl", "--device", "cpu", "--max-model-len", "512"]
    command += ["--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--no-hf"]
    command += ["--image-size", "56", "84", "--peer", "vllm", "--peer-python", fake_peer]
    proc = subprocess.run(
        [*command, "--output-json", str(out)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["vllm"]["prompt_tokens"] == result["mm_serve"]["prompt_tokens"]
    assert result["mm_serve_over_vllm"] == pytest.approx(
        result["mm_serve"]["output_tokens_per_s"] / (3 * 3 / 2)
    )
    assert "mm_serve / vLLM (same requests)" in proc.stdout
    dataset = random_image_dataset(3 + throughput.NUM_WARMUP_REQUESTS, 8, 3, (56, 84), 1, 0)
    texts = common.prompt_texts(dataset, "qwen2_vl")
    log = _peer_log(tmp_path)
    assert log["texts"] == texts[throughput.NUM_WARMUP_REQUESTS :]
    assert log["warmup_texts"] == texts[: throughput.NUM_WARMUP_REQUESTS]
    assert result["roofline"] is None  # CPU
