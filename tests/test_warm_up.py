"""The start-up warm-up's size: a batch that fills the largest step on CUDA, one request else."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mm_serve.frontend.warm_up import BATCH_IMAGE_SIZE, warm_up_batch_size, warm_up_image_size


def _config(device: str, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256):
    scheduler = SimpleNamespace(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
    )
    return SimpleNamespace(device=torch.device(device), scheduler=scheduler)


def test_cuda_warm_up_fills_the_token_budget_and_leaves_decode_rows():
    config = _config("cuda")
    # 300-token prompts: 28 fill 8,192 tokens (27 would leave 92 unused); one more decodes.
    assert warm_up_batch_size(config, 300) == 29
    assert 300 * (warm_up_batch_size(config, 300) - 1) >= 8192
    assert warm_up_batch_size(config, 8192) == 2
    assert warm_up_image_size(config) == BATCH_IMAGE_SIZE


def test_cuda_warm_up_stays_within_max_num_seqs():
    assert warm_up_batch_size(_config("cuda", max_num_seqs=8), 100) == 8
    assert warm_up_batch_size(_config("cuda", max_num_seqs=1), 100) == 1


def test_cpu_warm_up_is_one_small_request():
    config = _config("cpu")
    assert warm_up_batch_size(config, 300) == 1
    assert warm_up_image_size(config) < BATCH_IMAGE_SIZE
