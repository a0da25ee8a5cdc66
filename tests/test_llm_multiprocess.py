"""The offline ``LLM`` with its engine core in another process (the default on CUDA): the same
outputs as in-process, images included; bad prompts still fail cleanly; shutdown stops it."""

from __future__ import annotations

import numpy as np
import psutil
import pytest
from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.frontend.exceptions import EngineDeadError
from mm_serve.frontend.remote_core import RemoteEngineCore
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def completions(outputs) -> list[tuple[str, list[int], str]]:
    return [(c.text, c.token_ids, c.finish_reason) for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen2_vl")
    build_tiny_vlm_checkpoint(path, "qwen2_vl")
    return str(path)


def image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_text_outputs_match_in_process(llama_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    local = LLM(llama_path, block_size=4, multiprocess=False)
    reference = local.generate(["Hello there", "Once upon a time"], greedy, use_tqdm=False)
    stop = reference[1].outputs[0].text[3:6]
    params = [
        greedy,
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]),
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
    ]
    prompts = ["Hello there", "Once upon a time", "Count"]
    expected = completions(local.generate(prompts, params, use_tqdm=False))
    local.shutdown()

    llm = LLM(llama_path, block_size=4, multiprocess=True)
    assert isinstance(llm.engine_core, RemoteEngineCore)
    core = psutil.Process(llm.engine_core.client.pid)
    assert completions(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert expected[1][2] == "stop" and stop not in expected[1][0]
    # A bad prompt among good ones: the call fails, and the engine core keeps nothing.
    with pytest.raises(ValueError, match="Prompt token ids must be in"):
        llm.generate(["fine", {"prompt_token_ids": [1, 10**7]}], greedy, use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert completions(llm.generate(prompts, params, use_tqdm=False)) == expected
    llm.shutdown()
    assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE
    with pytest.raises(EngineDeadError):
        llm.generate("Hello there", greedy, use_tqdm=False)


def test_image_outputs_match_in_process(vlm_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [
        {"prompt": f"{PLACEHOLDER}Describe it.", "multi_modal_data": {"image": image(64, 48, i)}}
        for i in range(6)
    ] + ["No image here."]
    local = LLM(vlm_path, multiprocess=False, max_num_batched_tokens=64)
    expected = completions(local.generate(prompts, greedy, use_tqdm=False))
    local.shutdown()
    llm = LLM(vlm_path, multiprocess=True, max_num_batched_tokens=64)
    try:
        assert completions(llm.generate(prompts, greedy, use_tqdm=False)) == expected
    finally:
        llm.shutdown()


def test_failed_start_leaves_no_engine_process(tmp_path):
    """The engine core process starts before the config is resolved; a config that cannot
    be resolved stops it."""
    children = set(psutil.Process().children(recursive=True))
    with pytest.raises((ValueError, OSError)):
        LLM(str(tmp_path / "no-such-model"), multiprocess=True)
    left = set(psutil.Process().children(recursive=True)) - children
    alive = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    # multiprocessing's resource tracker: one per process, started with the first child.
    alive = [p for p in alive if "resource_tracker" not in " ".join(p.cmdline())]
    assert not alive, [p.cmdline() for p in alive]
