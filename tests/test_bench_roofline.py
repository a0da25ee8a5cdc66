"""The roofline of ``bench throughput``: its counts against hand computations from the published
config values, the issue's own arithmetic, and the rate measurement."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig

from mm_serve.benchmarks import roofline
from mm_serve.benchmarks.roofline import Rates, Workload
from tests.fixtures.checkpoints import write_architecture

ISSUE_RATES = Rates(matmul_flops_per_s=800e12, copy_bytes_per_s=3.0e12)


@pytest.fixture(scope="module")
def qwen2_vl_2b(tmp_path_factory):
    folder = write_architecture("qwen2-vl-2b", tmp_path_factory.mktemp("a"))
    return AutoConfig.from_pretrained(folder)


@pytest.fixture(scope="module")
def qwen2_5_vl_7b(tmp_path_factory):
    folder = write_architecture("qwen2.5-vl-7b", tmp_path_factory.mktemp("b"))
    return AutoConfig.from_pretrained(folder)


def test_qwen2_vl_2b_workload_by_hand(qwen2_vl_2b) -> None:
    """Workload 1 of the issue: 256 x (448x448 image + 50 tokens) -> 128, written out from the
    published sizes (vision: 32 blocks of width 1280, MLP 5120, 16 heads; LM: hidden 1536, MLP
    8960, 28 layers, 12 x 128 query and 2 x 128 KV widths, vocab 151936, tied)."""
    out = roofline.roofline(qwen2_vl_2b, Workload(256, (448, 448), 1, 50, 128), ISSUE_RATES)
    n, d = 32 * 32, 1280  # 448 / 14 = 32 patches a side
    block = 2 * n * 4 * d * d + 2 * n * 2 * d * 5120 + 4 * n * n * d
    merger = 2 * 256 * 5120 * 5120 + 2 * 256 * 5120 * 1536
    per_image = 2 * n * (3 * 2 * 14 * 14) * d + 32 * block + merger
    assert out["image_tokens"] == 256 and out["prompt_tokens"] == 306
    assert out["vision_flops"] == pytest.approx(256 * per_image, rel=1e-12)
    assert 370e12 < out["vision_flops"] < 385e12  # the issue: ~374 TFLOP (its blocks only)

    params = 28 * (2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960)  # 1.31e9
    t, head = 306, 1536 * 151936
    prefill = 256 * (2 * params * t + 2 * t * (t + 1) * 1536 * 28 + 2 * head)
    assert out["prefill_flops"] == pytest.approx(prefill, rel=1e-12)
    assert 2 * params * t * 256 == pytest.approx(205e12, rel=0.01)  # the issue's ~205 TFLOP

    weights, kv_token = (params + head) * 2, 2 * 28 * 256 * 2
    steps = [weights + 256 * (t + k) * kv_token for k in range(1, 128)]
    assert 5e9 < steps[0] < steps[-1] < 6.5e9  # the issue: steps of ~6 GB
    assert out["decode_bytes"] == pytest.approx(sum(steps), rel=1e-12)
    total = (256 * per_image + prefill) / 800e12 + sum(steps) / 3.0e12  # memory-bound decode
    assert out["total_s"] == pytest.approx(total, rel=1e-12)
    assert out["output_tokens_per_s"] == pytest.approx(256 * 128 / total, rel=1e-12)
    assert 31_000 < out["output_tokens_per_s"] < 36_000  # the issue: ~33,000


def test_qwen2_5_vl_7b_window_attention_by_hand(qwen2_5_vl_7b) -> None:
    """Workload 2's image, 1280x720: resized to 1288x728 = 92 x 52 patches, 46 x 26 merged
    tokens, windows of 4 x 4 merged tokens: 66 full windows (64 patches), 17 halves (32),
    one quarter (16): 4784 patches. Blocks 7, 15, 23, 31 attend over all 4784 patches."""
    out = roofline.roofline(qwen2_5_vl_7b, Workload(1, (1280, 720), 1, 20, 1), ISSUE_RATES)
    n, d = 52 * 92, 1280
    assert out["image_tokens"] == n // 4 == 1196
    windowed = 4 * (66 * 64**2 + 17 * 32**2 + 16**2) * d
    linear = 2 * n * 4 * d * d + 2 * n * 3 * d * 3420
    merger = 2 * (n // 4) * 5120 * 5120 + 2 * (n // 4) * 5120 * 3584
    vision = 2 * n * 1176 * d + 32 * linear + 28 * windowed + 4 * 4 * n * n * d + merger
    assert out["vision_flops"] == pytest.approx(vision, rel=1e-12)
    params = 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)
    assert params == pytest.approx(6.53e9, rel=0.01)  # 8.29e9 - 2 x 0.545e9 embed/head - tower
    t = 1196 + 20
    flops = 2 * params * t + 2 * t * (t + 1) * 3584 * 28 + 2 * 3584 * 152064
    assert out["prefill_flops"] == pytest.approx(flops, rel=1e-12)
    assert out["decode_s"] == 0  # one output token: the prefill gives it


def test_decode_step_takes_the_slower_of_compute_and_memory(qwen2_vl_2b) -> None:
    workload = Workload(8, (448, 448), 1, 50, 16)
    slow_matmul = roofline.roofline(qwen2_vl_2b, workload, Rates(1e9, 1e15))
    assert slow_matmul["decode_s"] == pytest.approx(slow_matmul["decode_flops"] / 1e9)
    slow_copy = roofline.roofline(qwen2_vl_2b, workload, Rates(1e15, 1e9))
    assert slow_copy["decode_s"] == pytest.approx(slow_copy["decode_bytes"] / 1e9)


def test_images_of_varied_sizes_count_one_by_one(qwen2_vl_2b) -> None:
    """``image_sizes``: each image's tower FLOPs and each request's prefill at its own prompt
    length; decode at the mean context (linear in it). Equal sizes give the fixed workload."""
    sizes = ((448, 448), (896, 448))  # 256 and 512 image tokens
    out = roofline.roofline(qwen2_vl_2b, Workload(2, (448, 448), 1, 50, 4, sizes), ISSUE_RATES)
    grids = [roofline.image_grid(qwen2_vl_2b.vision_config, *size) for size in sizes]
    assert out["vision_flops"] == sum(roofline.vision_flops(qwen2_vl_2b, g) for g in grids)
    lm = roofline.LMShape.from_config(qwen2_vl_2b.text_config)
    assert out["prefill_flops"] == pytest.approx(lm.prefill_flops(306) + lm.prefill_flops(562))
    assert out["prompt_tokens"] == 434 and out["image_tokens"] == 384
    same = ((448, 448),) * 2
    fixed = roofline.roofline(qwen2_vl_2b, Workload(2, (448, 448), 1, 50, 4), ISSUE_RATES)
    varied = roofline.roofline(qwen2_vl_2b, Workload(2, (448, 448), 1, 50, 4, same), ISSUE_RATES)
    assert varied == pytest.approx(fixed)
    with pytest.raises(ValueError, match="4 image sizes for 2 requests"):
        roofline.roofline(qwen2_vl_2b, Workload(2, (448, 448), 1, 50, 4, same * 2), ISSUE_RATES)


def test_unmodelled_model_type_is_an_error(qwen2_vl_2b) -> None:
    config = AutoConfig.for_model("llava")
    with pytest.raises(ValueError, match="No roofline for model type 'llava'"):
        roofline.roofline(config, Workload(1, (336, 336), 1, 10, 2), ISSUE_RATES)


def test_bench_roofline_from_a_throughput_result(qwen2_vl_2b, monkeypatch) -> None:
    """The text tokens come from our run's prompt count; each engine gets its percentage."""
    monkeypatch.setattr(roofline, "measure_rates", lambda device: ISSUE_RATES)
    result = {
        "workload": {"image_size": [448, 448], "num_images": 1, "output_len": 128},
        "mm_serve": {"num_requests": 256, "prompt_tokens": 256 * 306, "output_tokens_per_s": 8e3},
        "vllm": {"output_tokens_per_s": 2e4},
    }
    out = roofline.bench_roofline(qwen2_vl_2b, result, torch.device("cuda"))
    expected = roofline.roofline(qwen2_vl_2b, Workload(256, (448, 448), 1, 50, 128), ISSUE_RATES)
    assert out["workload"]["text_tokens"] == 50
    assert out["output_tokens_per_s"] == pytest.approx(expected["output_tokens_per_s"])
    assert out["matmul_flops_per_s"] == 800e12 and out["copy_bytes_per_s"] == 3.0e12
    percent = out["percent_of_roofline"]
    assert set(percent) == {"mm_serve", "vllm"}
    assert percent["vllm"] == pytest.approx(100 * 2e4 / expected["output_tokens_per_s"])
    assert roofline.bench_roofline(qwen2_vl_2b, result, torch.device("cpu")) is None
    # Images of varied sizes: the text tokens are what the images leave of the prompt tokens.
    result["workload"]["image_sizes"] = [[448, 448], [896, 448]] * 128
    result["mm_serve"]["prompt_tokens"] = 256 * 50 + 128 * (256 + 512)
    out = roofline.bench_roofline(qwen2_vl_2b, result, torch.device("cuda"))
    assert out["workload"]["text_tokens"] == 50 and out["prompt_tokens"] == 434


def test_measure_rates_on_cpu() -> None:
    rates = roofline.measure_rates("cpu", matmul_size=128, copy_bytes=1 << 22)
    assert math.isfinite(rates.matmul_flops_per_s) and math.isfinite(rates.copy_bytes_per_s)
    assert 1e7 < rates.matmul_flops_per_s < 1e13  # a few CPU cores, bf16
    assert 1e7 < rates.copy_bytes_per_s < 1e12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_rates_on_cuda_agree_with_cuda_events() -> None:
    rates = roofline.measure_rates("cuda")
    src = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    by_events = 2 * (1 << 30) / sorted(times)[5]
    assert rates.copy_bytes_per_s == pytest.approx(by_events, rel=0.25)
    assert rates.matmul_flops_per_s > 50e12  # any bf16 tensor-core GPU
