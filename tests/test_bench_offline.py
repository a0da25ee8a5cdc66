"""The offline benchmarks: ``load_format="dummy"``, the architecture folders, and
``mm-serve bench throughput`` / ``bench latency`` run as subprocesses on the tiny architecture.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoProcessor

from mm_serve.config import EngineArgs
from mm_serve.models.loader import load_model
from tests.fixtures.checkpoints import write_architecture
from tests.fixtures.images import generated

# The web stack and the engine core's socket: an engine in this process needs neither (msgspec,
# a core dependency, it does need: ``EngineCoreOutput`` is a msgspec Struct).
WEB_MODULES = ("fastapi", "starlette", "uvicorn", "zmq")


@pytest.fixture(scope="module")
def tiny_arch(tmp_path_factory) -> str:
    return write_architecture("tiny-qwen2-vl", tmp_path_factory.mktemp("tiny-arch"))


def _model_config(path: str, **kwargs):
    args = EngineArgs(model=path, device="cpu", load_format="dummy", **kwargs)
    return args.create_engine_config().model


# The published values (tiny: the 2B's shape at toy size). Text: hidden, intermediate, layers,
# heads, KV heads, vocab, max positions; vision: depth, width, heads, output width.
PUBLISHED = {
    "qwen2-vl-2b": ((1536, 8960, 28, 12, 2, 151936, 32768), (32, 1280, 16, 1536), True),
    "qwen2-vl-7b": ((3584, 18944, 28, 28, 4, 152064, 32768), (32, 1280, 16, 3584), False),
    "qwen2.5-vl-7b": ((3584, 18944, 28, 28, 4, 152064, 128000), (32, 1280, 16, 3584), False),
    "tiny-qwen2-vl": ((64, 128, 2, 4, 2, 151936, 4096), (2, 32, 2, 64), True),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_architecture_has_the_published_config(tmp_path, name) -> None:
    """HF and our engine read the published sizes from the folder, and both preprocess a
    448x448 and a 1280x720 image into the published token counts."""
    from mm_serve.encoders.processors import get_image_processor

    text, vision, tied = PUBLISHED[name]
    folder = write_architecture(name, tmp_path)
    assert not [f for f in os.listdir(folder) if f.endswith((".safetensors", ".bin"))]
    config = AutoConfig.from_pretrained(folder)
    t, v = config.text_config, config.vision_config
    shape = (t.hidden_size, t.intermediate_size, t.num_hidden_layers)
    heads = (t.num_attention_heads, t.num_key_value_heads, t.vocab_size)
    assert shape + heads + (t.max_position_embeddings,) == text
    if config.model_type == "qwen2_5_vl":
        assert (v.depth, v.hidden_size, v.num_heads, v.out_hidden_size) == vision
        assert (v.window_size, v.fullatt_block_indexes) == (112, [7, 15, 23, 31])
    else:
        assert (v.depth, v.embed_dim, v.num_heads, v.hidden_size) == vision
    assert config.tie_word_embeddings is tied
    tiny = name.startswith("tiny")
    assert t.rope_parameters["mrope_section"] == ([2, 3, 3] if tiny else [16, 24, 24])
    assert t.rope_parameters["rope_theta"] == 1e6
    assert t.dtype == (torch.float32 if tiny else torch.bfloat16)
    with open(os.path.join(folder, "tokenizer.json")) as f:
        ids = {token["content"]: token["id"] for token in json.load(f)["added_tokens"]}
    assert config.image_token_id == ids["<|image_pad|>"]
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert t.eos_token_id == ids["<|im_end|>"]
    engine = EngineArgs(model=folder, device="cpu", load_format="dummy").create_engine_config()
    m = engine.model
    assert (m.num_layers, m.num_kv_heads, m.vocab_size) == (text[2], text[4], text[5])
    assert (m.head_dim, m.max_model_len, m.dtype) == (text[0] // text[3], text[6], t.dtype)
    assert engine.multimodal.max_image_tokens == 12845056 // 28**2
    ours = get_image_processor(folder, config)
    hf = AutoProcessor.from_pretrained(folder).image_processor
    for (width, height), tokens in {(448, 448): 256, (1280, 720): 46 * 26}.items():
        image = generated(width, height, seed=0)
        assert ours.preprocess(image).num_tokens == tokens
        grid = hf(images=[image], return_tensors="pt")["image_grid_thw"]
        assert int(grid.prod()) // 4 == tokens


def test_architecture_files_are_transformers_own(tmp_path) -> None:
    """Every settings file is what transformers writes for the object it loads from it."""
    from transformers import AutoImageProcessor, GenerationConfig

    folder, again = tmp_path / "a", tmp_path / "b"
    write_architecture("qwen2.5-vl-7b", folder)
    AutoConfig.from_pretrained(folder).save_pretrained(again)
    AutoImageProcessor.from_pretrained(folder).save_pretrained(again)
    GenerationConfig.from_pretrained(folder).save_pretrained(again)
    for file in ("config.json", "preprocessor_config.json", "generation_config.json"):
        assert (again / file).read_text() == (folder / file).read_text(), file


def test_unknown_architecture_and_load_format(tmp_path, tiny_arch, capsys) -> None:
    with pytest.raises(SystemExit):
        write_architecture("qwen2-vl-3b", tmp_path)
    assert "invalid choice: 'qwen2-vl-3b'" in capsys.readouterr().err
    config = dataclasses.replace(_model_config(tiny_arch), load_format="npcache")
    with pytest.raises(ValueError, match="Unknown load_format 'npcache'"):
        load_model(config, "cpu")


def test_dummy_weights_are_seeded_random_and_tied(tiny_arch) -> None:
    model = load_model(_model_config(tiny_arch), "cpu")
    again = load_model(_model_config(tiny_arch), "cpu")
    other_seed = load_model(_model_config(tiny_arch, seed=1), "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.shape == (151936, 64)
    for name, param in model.named_parameters():
        assert torch.equal(param, again.get_parameter(name)), name
        if name.endswith(".bias"):
            assert not param.any(), name
        elif "norm" in name or ".ln_q." in name:
            assert torch.all(param == 1), name
        else:
            assert 0.015 < param.float().std() < 0.025, name
            assert not torch.equal(param, other_seed.get_parameter(name)), name
    rotary = model.model.layers[0].self_attn.attn.rotary_emb.cos_sin_cache
    assert torch.isfinite(rotary).all() and rotary[:, 0].abs().sum() > 0


def test_dummy_model_generates_with_images(tiny_arch) -> None:
    """No weight files: built from config.json alone; a 448x448 image is 256 placeholder
    tokens; outputs have the forced length."""
    from mm_serve import LLM, SamplingParams

    llm = LLM(tiny_arch, load_format="dummy", device="cpu", max_model_len=1024)
    try:
        image = Image.new("RGB", (448, 448), (200, 30, 90))
        prompt = "look at this <|vision_start|><|image_pad|><|vision_end|>"
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        prompts = [{"prompt": prompt, "multi_modal_data": {"image": [image]}}, "just words"]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    image_token_id = llm.config.model.hf_config.image_token_id
    assert outputs[0].prompt_token_ids.count(image_token_id) == 256
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5]


def test_detokenizer_skips_ids_the_small_tokenizer_lacks(tiny_arch) -> None:
    """A random model samples ids up to the published vocab; the stand-in tokenizer has ~400."""
    from mm_serve.frontend.detokenizer import IncrementalDetokenizer
    from mm_serve.frontend.processor import load_tokenizer
    from mm_serve.messages.sampling_params import SamplingParams

    tokenizer = load_tokenizer(tiny_arch)
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams())
    assert detokenizer.update([151935, 100000]) is None
    assert detokenizer.text == ""
    detokenizer.update(tokenizer.encode("the"))
    assert detokenizer.text == "the"


def _run_bench(args: list[str], tmp_path) -> tuple[dict, str]:
    """``python -X importtime -m mm_serve.entrypoints.cli bench ...``; returns the JSON and
    the modules the process (and its preprocessing workers) imported."""
    out = tmp_path / "result.json"
    command = [sys.executable, "-X", "importtime", "-m", "mm_serve.entrypoints.cli", "bench"]
    common = ["--model-arch", "tiny-qwen2-vl", "--device", "cpu", "--max-model-len", "512"]
    proc = subprocess.run(
        [*command, *args, *common, "--output-json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = set(re.findall(r"^import time:.*\|\s*(\S+)$", proc.stderr, re.MULTILINE))
    assert "mm_serve.entrypoints.llm" in modules  # the parse found the imports
    assert not {m.split(".")[0] for m in modules} & set(WEB_MODULES)
    return json.loads(out.read_text()), proc.stdout


def test_bench_throughput_cli(tmp_path) -> None:
    args = ["throughput", "--num-prompts", "5", "--input-len", "8", "--output-len", "4"]
    args += ["--image-size", "56", "56", "--hf-batch-sizes", "2", "--compare-prefix-caching"]
    result, stdout = _run_bench([*args, "--compare-structured-outputs"], tmp_path)
    assert "mm_serve / HF best (batch 2)" in stdout and "JSON schema / none" in stdout
    assert result["mm_serve_json_schema"]["structured_outputs"] is True
    assert result["json_schema_over_none"] > 0
    for key in ("mm_serve", "mm_serve_prefix_caching_off", "mm_serve_json_schema"):
        run = result[key]
        assert run["num_requests"] == 5 and run["output_tokens"] == 5 * 4
        assert run["prompt_tokens"] > 5 * (8 + 4)  # words, then 4 image tokens + 2 markers
        assert run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0
        assert run["total_tokens_per_s"] > run["output_tokens_per_s"]
        assert run["prefix_cache_hits"] == 0
    assert result["mm_serve"]["prefix_cache_queries"] == result["mm_serve"]["prompt_tokens"]
    assert result["mm_serve_prefix_caching_off"]["enable_prefix_caching"] is False
    (hf,) = result["hf"]["batches"]
    assert hf["batch_size"] == 2 and hf["output_tokens"] == 2 * 4 and hf["error"] is None
    assert result["hf"]["best"]["output_tokens_per_s"] > 0
    assert result["mm_serve_over_hf_best"] > 0 and result["prefix_caching_on_over_off"] > 0
    assert result["load_format"] == "dummy" and result["dtype"] == "float32"


def test_bench_throughput_cli_with_varied_image_sizes(tmp_path) -> None:
    """``--max-image-size``: each image's size is drawn, recorded in the workload, and the HF
    baseline (same requests) gets the same tokens; ``--peer-bench`` (one size) refuses it."""
    args = ["throughput", "--num-prompts", "4", "--input-len", "6", "--output-len", "3"]
    args += ["--image-size", "56", "56", "--max-image-size", "112", "140", "--hf-batch-sizes", "4"]
    result, stdout = _run_bench(args, tmp_path)
    workload = result["workload"]
    assert workload["max_image_size"] == [112, 140] and len(workload["image_sizes"]) == 4
    assert all(56 <= w <= 112 and 56 <= h <= 140 for w, h in workload["image_sizes"])
    assert len({tuple(size) for size in workload["image_sizes"]}) > 1
    assert "1 x 56x56-112x140 image(s)" in stdout
    assert result["mm_serve"]["output_tokens"] == 4 * 3 and result["hf"]["best"] is not None
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", "bench", *args, "--no-hf"]
    command += ["--peer", "vllm", "--peer-bench"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--peer-bench sends vLLM's random-mm" in proc.stderr


def test_bench_latency_cli(tmp_path, tiny_arch) -> None:
    args = ["latency", "--batch-size", "2", "--input-len", "8", "--output-len", "6"]
    args += ["--image-size", "56", "56", "--num-iters", "2", "--num-iters-warmup", "1"]
    result, stdout = _run_bench(args, tmp_path)
    assert "decode step:" in stdout and "floors: skipped" in stdout
    for key in ("latency", "latency_output_len_1"):
        stats = result[key]
        assert len(stats["latencies_s"]) == 2
        assert 0 < min(stats["latencies_s"]) <= stats["median_s"] <= stats["p99_s"]
    assert result["decode_step_ms"] is not None
    assert result["all_weight_bytes"] > result["lm_weight_bytes"] > 0
    # Tied: the whole model counts the matrix once, the LM-only bytes count it as the head.
    model = load_model(_model_config(tiny_arch), "cpu")
    vision = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("visual."))
    assert result["all_weight_bytes"] - result["lm_weight_bytes"] == vision
    assert result["floor_lm_weights_ms"] is None  # no copy bandwidth on CPU


@pytest.mark.parametrize("images", [[], ["--image-size", "56", "56"]], ids=["text", "images"])
def test_bench_host_overhead_cli(images) -> None:
    """The engine core's host work per decode step, and the front end's: a row per batch size,
    every timed step gave each request a token (the script checks it)."""
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", "bench", "host-overhead"]
    args = ["--batch-sizes", "1", "4", "--steps", "5", *images]
    proc = subprocess.run([*command, *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = r"^\s*(\d+) \|\s*([\d.]+) \|\s*([\d.]+) \|\s*([\d.]+)$"
    rows = re.findall(row, proc.stdout, re.MULTILINE)
    assert [int(batch) for batch, *_ in rows] == [1, 4]
    for batch, step_ms, per_request_us, front_end_ms in rows:
        assert float(step_ms) > 0 and float(front_end_ms) > 0
        assert abs(float(per_request_us) - float(step_ms) * 1e3 / int(batch)) < 1.0  # rounding
