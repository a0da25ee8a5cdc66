"""``mm-serve bench roofline``: its counts against hand computations from the published config
values, the issue's own arithmetic, the roofline of a ``bench throughput`` result, and the rate
measurement. Rates are given (``--matmul-tflops 800 --copy-tbps 3``, the issue's) unless a test
measures them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mm_serve.entrypoints import cli
from tests.fixtures.checkpoints import write_architecture

ISSUE_RATES = ["--matmul-tflops", "800", "--copy-tbps", "3"]


@pytest.fixture(scope="module")
def qwen2_vl_2b(tmp_path_factory) -> str:
    return write_architecture("qwen2-vl-2b", tmp_path_factory.mktemp("a"))


@pytest.fixture(scope="module")
def qwen2_5_vl_7b(tmp_path_factory) -> str:
    return write_architecture("qwen2.5-vl-7b", tmp_path_factory.mktemp("b"))


def bench_roofline(tmp_path, model: str, *flags: str) -> dict:
    """``mm-serve bench roofline --model MODEL FLAGS`` in this process; its JSON."""
    path = tmp_path / "roofline.json"
    argv = ["bench", "roofline", "--model", model, *flags, "--output-json", str(path)]
    assert cli.main(argv) == 0
    return json.loads(path.read_text())


def workload(requests: int, size: tuple[int, int], text: int, output: int) -> list[str]:
    """The flags of ``requests`` x (one ``size`` image + ``text`` tokens) -> ``output``."""
    return ["--num-prompts", str(requests), "--image-size", *map(str, size), "--num-images",
            "1", "--text-tokens", str(text), "--output-len", str(output)]  # fmt: skip


def qwen2_vl_2b_image_flops(height: int, width: int) -> int:
    """Qwen2-VL-2B's tower on one image of ``height x width`` patches, from the published sizes
    (32 blocks of width 1280, MLP 5120, 16 heads; merger 2x2 -> 5120 -> 1536)."""
    n, d = height * width, 1280
    block = 2 * n * 4 * d * d + 2 * n * 2 * d * 5120 + 4 * n * n * d
    merger = 2 * (n // 4) * 5120 * 5120 + 2 * (n // 4) * 5120 * 1536
    return 2 * n * (3 * 2 * 14 * 14) * d + 32 * block + merger


# The Qwen2-VL-2B LM: hidden 1536, MLP 8960, 28 layers, 12 x 128 query and 2 x 128 KV widths,
# vocab 151936, tied.
QWEN2_VL_2B_PARAMS = 28 * (2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960)  # 1.31e9
QWEN2_VL_2B_HEAD = 1536 * 151936


def qwen2_vl_2b_prefill_flops(t: int) -> int:
    return 2 * QWEN2_VL_2B_PARAMS * t + 2 * t * (t + 1) * 1536 * 28 + 2 * QWEN2_VL_2B_HEAD


def test_qwen2_vl_2b_workload_by_hand(qwen2_vl_2b, tmp_path, capsys) -> None:
    """Workload 1 of the issue: 256 x (448x448 image + 50 tokens) -> 128."""
    out = bench_roofline(tmp_path, qwen2_vl_2b, *workload(256, (448, 448), 50, 128), *ISSUE_RATES)
    per_image = qwen2_vl_2b_image_flops(32, 32)  # 448 / 14 = 32 patches a side
    assert out["image_tokens"] == 256 and out["prompt_tokens"] == 306
    assert out["vision_flops"] == pytest.approx(256 * per_image, rel=1e-12)
    assert 370e12 < out["vision_flops"] < 385e12  # the issue: ~374 TFLOP (its blocks only)

    t = 306
    prefill = 256 * qwen2_vl_2b_prefill_flops(t)
    assert out["prefill_flops"] == pytest.approx(prefill, rel=1e-12)
    assert 2 * QWEN2_VL_2B_PARAMS * t * 256 == pytest.approx(205e12, rel=0.01)  # the issue's

    weights, kv_token = (QWEN2_VL_2B_PARAMS + QWEN2_VL_2B_HEAD) * 2, 2 * 28 * 256 * 2
    steps = [weights + 256 * (t + k) * kv_token for k in range(1, 128)]
    assert 5e9 < steps[0] < steps[-1] < 6.5e9  # the issue: steps of ~6 GB
    assert out["decode_bytes"] == pytest.approx(sum(steps), rel=1e-12)
    total = (256 * per_image + prefill) / 800e12 + sum(steps) / 3.0e12  # memory-bound decode
    assert out["total_s"] == pytest.approx(total, rel=1e-12)
    assert out["output_tokens_per_s"] == pytest.approx(256 * 128 / total, rel=1e-12)
    assert 31_000 < out["output_tokens_per_s"] < 36_000  # the issue: ~33,000
    assert (out["matmul_flops_per_s"], out["copy_bytes_per_s"]) == (800e12, 3e12)
    assert out["workload"]["text_tokens"] == 50 and not out["rates_measured"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"roofline: {out['output_tokens_per_s']:,.0f} out tok/s in ")
    assert lines[0].endswith("at 800 TFLOP/s (bf16 matmul) and 3.00 TB/s (copy, read + write), "
                             "as given")  # fmt: skip
    assert f"vision {out['vision_flops'] / 1e12:,.1f} TFLOP" in lines[1]


def test_qwen2_5_vl_7b_window_attention_by_hand(qwen2_5_vl_7b, tmp_path) -> None:
    """Workload 2's image, 1280x720: resized to 1288x728 = 92 x 52 patches, 46 x 26 merged
    tokens, windows of 4 x 4 merged tokens: 66 full windows (64 patches), 17 halves (32),
    one quarter (16): 4784 patches. Blocks 7, 15, 23, 31 attend over all 4784 patches."""
    out = bench_roofline(tmp_path, qwen2_5_vl_7b, *workload(1, (1280, 720), 20, 1), *ISSUE_RATES)
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


def test_decode_step_takes_the_slower_of_compute_and_memory(qwen2_vl_2b, tmp_path) -> None:
    flags = workload(8, (448, 448), 50, 16)
    slow_matmul = bench_roofline(tmp_path, qwen2_vl_2b, *flags, "--matmul-tflops", "1e-3",
                                 "--copy-tbps", "1000")  # fmt: skip
    assert slow_matmul["decode_s"] == pytest.approx(slow_matmul["decode_flops"] / 1e9)
    slow_copy = bench_roofline(tmp_path, qwen2_vl_2b, *flags, "--matmul-tflops", "1000",
                               "--copy-tbps", "1e-3")  # fmt: skip
    assert slow_copy["decode_s"] == pytest.approx(slow_copy["decode_bytes"] / 1e9)


def throughput_result(image_sizes: list | None = None, **mm_serve) -> dict:
    """A ``bench throughput --output-json`` result's fields that the roofline reads."""
    workload = {"image_size": [448, 448], "num_images": 1, "output_len": 128}
    if image_sizes is not None:
        workload["image_sizes"] = image_sizes
    ours = {"num_requests": 256, "prompt_tokens": 256 * 306, "output_tokens_per_s": 8e3}
    return {"model": "qwen2-vl-2b", "workload": workload, "mm_serve": {**ours, **mm_serve},
            "vllm": {"output_tokens_per_s": 2e4}}  # fmt: skip


def roofline_of_result(tmp_path, model: str, result: dict, *flags: str) -> dict:
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps(result))
    return bench_roofline(tmp_path, model, "--result", str(path), *ISSUE_RATES, *flags)


def test_roofline_of_a_throughput_result(qwen2_vl_2b, tmp_path, capsys) -> None:
    """The text tokens come from the run's prompt count; each engine gets its percentage."""
    out = roofline_of_result(tmp_path, qwen2_vl_2b, throughput_result())
    expected = bench_roofline(tmp_path, qwen2_vl_2b, *workload(256, (448, 448), 50, 128),
                              *ISSUE_RATES)  # fmt: skip
    assert out["workload"]["text_tokens"] == 50
    assert out["output_tokens_per_s"] == pytest.approx(expected["output_tokens_per_s"])
    assert out["percent_of_roofline"] == pytest.approx(
        {"mm_serve": 100 * 8e3 / expected["output_tokens_per_s"],
         "vllm": 100 * 2e4 / expected["output_tokens_per_s"]}
    )  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    roof = out["output_tokens_per_s"]
    assert f"  vllm: {100 * 2e4 / roof:.1f}% of the roofline" in lines
    assert f"  mm_serve: {100 * 8e3 / roof:.1f}% of the roofline" in lines


def test_images_of_varied_sizes_count_one_by_one(qwen2_vl_2b, tmp_path) -> None:
    """A result's ``image_sizes``: each image's tower FLOPs and each request's prefill at its
    own prompt length; decode at the mean context. Equal sizes give the fixed workload."""
    sizes = [[448, 448], [896, 448]]  # 256 and 512 image tokens
    result = throughput_result(sizes, num_requests=2, prompt_tokens=2 * 50 + 256 + 512)
    result["workload"]["output_len"] = 4
    out = roofline_of_result(tmp_path, qwen2_vl_2b, result)
    by_hand = qwen2_vl_2b_image_flops(32, 32) + qwen2_vl_2b_image_flops(32, 64)
    assert out["vision_flops"] == pytest.approx(by_hand, rel=1e-12)
    prefill = qwen2_vl_2b_prefill_flops(306) + qwen2_vl_2b_prefill_flops(562)
    assert out["prefill_flops"] == pytest.approx(prefill, rel=1e-12)
    assert out["prompt_tokens"] == 434 and out["image_tokens"] == 384
    assert out["workload"]["text_tokens"] == 50

    same = throughput_result([[448, 448]] * 2, num_requests=2, prompt_tokens=2 * 306)
    fixed = throughput_result(num_requests=2, prompt_tokens=2 * 306)
    for result in (same, fixed):
        result["workload"]["output_len"] = 4
    varied = roofline_of_result(tmp_path, qwen2_vl_2b, same)
    fixed = roofline_of_result(tmp_path, qwen2_vl_2b, fixed)
    keys = ("vision_flops", "prefill_flops", "decode_bytes", "total_s", "output_tokens_per_s")
    assert [varied[k] for k in keys] == pytest.approx([fixed[k] for k in keys])
    same["workload"]["image_sizes"] *= 2
    with pytest.raises(SystemExit, match="4 image sizes for 2 requests"):
        roofline_of_result(tmp_path, qwen2_vl_2b, same)


def test_unmodelled_model_type_is_an_error(tmp_path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("llava").save_pretrained(tmp_path / "llava")
    with pytest.raises(SystemExit, match="No roofline for model type 'llava'"):
        bench_roofline(tmp_path, str(tmp_path / "llava"), *ISSUE_RATES)
    with pytest.raises(SystemExit, match="No roofline for model type 'gemma3'"):
        cli.main(["bench", "roofline", "--model-arch", "gemma-3-4b", *ISSUE_RATES])


def test_rates_measured_on_cpu(qwen2_vl_2b, tmp_path, capsys) -> None:
    out = bench_roofline(tmp_path, qwen2_vl_2b, *workload(2, (448, 448), 50, 4), "--device", "cpu")
    rates = out["matmul_flops_per_s"], out["copy_bytes_per_s"]
    assert all(math.isfinite(rate) for rate in rates) and out["rates_measured"]
    assert 1e7 < rates[0] < 1e13  # a few CPU cores, bf16
    assert 1e7 < rates[1] < 1e12
    assert capsys.readouterr().out.splitlines()[0].endswith("measured now")
    # One rate given: only the other is measured.
    out = bench_roofline(tmp_path, qwen2_vl_2b, "--device", "cpu", "--copy-tbps", "3")
    assert out["copy_bytes_per_s"] == 3e12 and out["matmul_flops_per_s"] < 1e13


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rates_measured_on_cuda_agree_with_cuda_events(qwen2_vl_2b, tmp_path) -> None:
    rates = bench_roofline(tmp_path, qwen2_vl_2b, "--device", "cuda")
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
    assert rates["copy_bytes_per_s"] == pytest.approx(by_events, rel=0.25)
    assert rates["matmul_flops_per_s"] > 50e12  # any bf16 tensor-core GPU
