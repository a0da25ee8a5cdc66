"""``bench throughput --peer vllm`` on CPU: the qwen2.5-vl-7b folder both engines load, and the
whole peer path through the CLI. vLLM itself is not here: a stand-in ``vllm`` package on
``--peer-pythonpath`` (``FAKE_VLLM``) takes the driver's ``LLM(...)`` and ``generate`` calls,
logs what it got (engine arguments, prompt texts, images) and answers with the prompt tokens
counted by the HF processor (as vLLM counts them) or a given number."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from mm_serve.entrypoints import cli
from tests.fixtures.checkpoints import write_architecture

FAKE_VLLM = '''
"""A stand-in for vllm: ``LLM(model, **kwargs).generate(prompts, params)`` logs its calls to
$FAKE_VLLM_LOG and gives each prompt ``max_tokens`` tokens and its prompt tokens as the HF
processor counts them ($FAKE_VLLM_PROMPT_TOKENS: that many for the first prompt, 0 for the
others); $FAKE_VLLM_EXIT: exit with that code at ``LLM(...)``."""
import hashlib
import json
import os
import sys

__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _Completion:
    def __init__(self, num_tokens):
        self.token_ids = [0] * num_tokens


class _RequestOutput:
    def __init__(self, prompt_tokens, num_tokens):
        self.prompt_token_ids = [0] * prompt_tokens
        self.outputs = [_Completion(num_tokens)]


def _image(image):
    return [image.mode, list(image.size), hashlib.sha256(image.tobytes()).hexdigest()]


class LLM:
    def __init__(self, model, **kwargs):
        if "FAKE_VLLM_EXIT" in os.environ:
            sys.exit(int(os.environ["FAKE_VLLM_EXIT"]))
        self.model, self.processor = model, None
        self.log = {"model": model, "kwargs": kwargs, "generate": [],
                    "pythonpath": os.environ["PYTHONPATH"]}

    def generate(self, prompts, params, use_tqdm=True):
        images = [p["multi_modal_data"]["image"] for p in prompts]
        self.log["generate"].append([{"text": p["prompt"], "images": [_image(i) for i in im]}
                                     for p, im in zip(prompts, images)])
        self.log["sampling"] = params.kwargs
        with open(os.environ["FAKE_VLLM_LOG"], "w") as f:
            json.dump(self.log, f)
        return [_RequestOutput(n, params.kwargs["max_tokens"]) for n in self._count(prompts)]

    def _count(self, prompts):
        fixed = os.environ.get("FAKE_VLLM_PROMPT_TOKENS")
        if fixed is not None:
            return [int(fixed)] + [0] * (len(prompts) - 1)
        if self.processor is None:
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(self.model)
        return [len(self.processor(text=[p["prompt"]], images=p["multi_modal_data"]["image"])
                    ["input_ids"][0]) for p in prompts]
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> str:
    """A site folder with the stand-in ``vllm``; its log goes to ``tmp_path/vllm-log.json``."""
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "vllm-log.json"))
    return str(tmp_path / "site")


# The workload of every run here: 3 requests of 8 words and one 56x84 image -> 3 tokens.
THROUGHPUT = ["bench", "throughput", "--model-arch", "tiny-qwen2-vl", "--device", "cpu",
              "--max-model-len", "512", "--num-prompts", "3", "--input-len", "8",
              "--output-len", "3", "--no-hf", "--image-size", "56", "84",
              "--peer", "vllm"]  # fmt: skip


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
    pixels = np.random.default_rng(0).integers(0, 256, (720, 1280, 3), np.uint8)
    image = Image.fromarray(pixels, "RGB")
    assert processor.preprocess(image).num_tokens == 1196
    with torch.device("meta"):
        ours, theirs = Qwen2_5_VLForConditionalGeneration(config), HFModel(config)
    sizes = [sum(p.numel() for p in m.parameters()) for m in (ours, theirs)]
    # Ours adds the vision MLP's zero padding (Qwen2_5_VisionMLP: width 3,420 -> 3,456).
    padding = 32 * (3456 - 3420) * (3 * 1280 + 2)
    assert sizes == [8_292_166_656 + padding, 8_292_166_656]


def test_bench_throughput_with_the_peer(fake_vllm, tmp_path) -> None:
    """The whole ``--peer vllm`` path: the peer gets our prompt texts and images, its engine
    arguments, vLLM's site first on PYTHONPATH, and counts the same prompt tokens as we do
    (the HF processor's count); the summary prints its row and the ratio."""
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", *THROUGHPUT, "--seed", "7"]
    command += ["--peer-pythonpath", fake_vllm, "--peer-engine-args", '{"max_num_seqs": 8}']
    proc = subprocess.run(
        [*command, "--output-json", str(out)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    ours, peer = result["mm_serve"], result["vllm"]
    assert peer["prompt_tokens"] == ours["prompt_tokens"] and peer["vllm_version"] == "0.0-fake"
    assert (peer["num_requests"], peer["output_tokens"]) == (3, 3 * 3)
    assert peer["output_tokens_per_s"] == pytest.approx(9 / peer["elapsed_s"])
    ratio = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
    assert result["mm_serve_over_vllm"] == pytest.approx(ratio)
    assert result["roofline"] is None  # CPU
    lines = proc.stdout.splitlines()
    assert f"mm_serve / vLLM (same requests): {ratio:.3f}x" in lines
    (row,) = [line for line in lines if line.startswith("vLLM 0.0-fake")]
    cells = [f"{peer['output_tokens_per_s']:.1f}", f"{peer['total_tokens_per_s']:.1f}"]
    assert row.split()[-3:] == [*cells, str(peer["prompt_tokens"])]
    assert "roofline: none (CUDA only; Qwen2-VL and Qwen2.5-VL)" in lines

    log = json.loads((tmp_path / "vllm-log.json").read_text())
    assert log["pythonpath"].split(os.pathsep)[0] == fake_vllm
    kwargs = log["kwargs"]
    assert (kwargs["load_format"], kwargs["seed"], kwargs["max_num_seqs"]) == ("dummy", 7, 8)
    assert kwargs["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    assert log["sampling"] == {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}
    warmup, timed = log["generate"]  # the warm-up call, then the timed one
    assert len(timed) == 3 and warmup
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    for prompt in warmup + timed:
        words, end = prompt["text"].split(placeholder)
        assert len(words.split()) == 8 and end == ""
        ((mode, size, _),) = prompt["images"]
        assert (mode, size) == ("RGB", [56, 84])
    sent = {(p["text"], p["images"][0][2]) for p in timed}
    assert len(sent) == 3 and not sent & {(p["text"], p["images"][0][2]) for p in warmup}


def test_the_peers_prompt_token_check_and_its_exit_code(fake_vllm, monkeypatch) -> None:
    """A peer that counts other prompt tokens than ours, or exits non-zero, fails the run."""
    argv = [*THROUGHPUT, "--peer-pythonpath", fake_vllm]
    monkeypatch.setenv("FAKE_VLLM_PROMPT_TOKENS", "123")
    with pytest.raises(RuntimeError, match=r"vLLM counted 123 prompt tokens, mm_serve \d+"):
        cli.main(argv)
    monkeypatch.setenv("FAKE_VLLM_EXIT", "3")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        cli.main(argv)
