"""``StepUpload``: a step's host arrays packed into one buffer and sent in one copy (CPU; on
CUDA the same code runs with pinned memory and a non-blocking copy)."""

import numpy as np
import pytest
import torch

from mm_serve.utils.transfer import StepUpload


def test_staged_arrays_arrive_with_their_dtype_and_shape_after_flush():
    upload = StepUpload(torch.device("cpu"), capacity=1001)  # rounded up to 1008
    arrays = [
        (np.arange(5, dtype=np.int32), torch.int64),  # converted
        (np.arange(6, dtype=np.int64).reshape(2, 3), torch.int32),
        (np.array([0.5, 1.5], dtype=np.float64), torch.float32),
        (np.array([2.5], dtype=np.float64), None),  # a dtype the table lacks
        (np.array([True, False, True]), None),  # kept as it is
        (np.zeros(0, dtype=np.int64), torch.int64),
    ]
    staged = [upload.stage(array, dtype) for array, dtype in arrays]
    upload.flush()
    for (array, dtype), tensor in zip(arrays, staged, strict=True):
        assert tensor.dtype == (dtype or torch.from_numpy(array).dtype)
        assert tensor.shape == array.shape
        assert tensor.data_ptr() % 8 == 0 or tensor.numel() == 0
        np.testing.assert_array_equal(tensor.numpy(), array.astype(tensor.numpy().dtype))


def test_a_flushed_view_keeps_its_contents_when_the_next_step_stages():
    upload = StepUpload(torch.device("cpu"), capacity=256)
    first = upload.stage(np.full(4, 7), torch.int64)
    upload.flush()
    second = upload.stage(np.full(4, 9), torch.int64)
    upload.flush()
    assert first.tolist() == [7] * 4 and second.tolist() == [9] * 4


def test_the_host_array_may_change_right_after_staging():
    upload = StepUpload(torch.device("cpu"))
    array = np.arange(8)
    tensor = upload.stage(array, torch.int64)
    array[:] = -1
    upload.flush()
    assert tensor.tolist() == list(range(8))


@pytest.mark.parametrize("first_size", [0, 10])
def test_an_array_past_the_capacity_goes_on_its_own_and_the_buffer_grows(first_size):
    upload = StepUpload(torch.device("cpu"), capacity=128)
    small = upload.stage(np.arange(first_size), torch.int64)
    big = upload.stage(np.arange(100), torch.int64)  # 800 bytes > 128
    upload.flush()
    assert small.tolist() == list(range(first_size)) and big.tolist() == list(range(100))
    assert upload.capacity >= 128 + 800
    again = upload.stage(np.arange(100), torch.int64)
    upload.flush()
    assert again.tolist() == list(range(100))
    assert again.untyped_storage().nbytes() == upload.capacity  # packed this time


def test_a_full_engine_step_fits_the_runners_upload(vlm_path):
    """``InputBatch.upload_capacity`` bounds what ``_prepare_inputs`` stages: steps of the full
    token budget, with images, chunked prompts, decode and every sampling setting, never grow
    it."""
    from mm_serve import LLM, SamplingParams
    from tests.fixtures.images import generated

    llm = LLM(
        vlm_path, max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8, multiprocess=False
    )
    runner = llm.engine_core.model_runner
    capacity = runner.upload.capacity
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
    prompts = [
        {
            "prompt": " ".join(words[(i + j) % len(words)] for j in range(30))
            + "<|vision_start|><|image_pad|><|vision_end|>",
            "multi_modal_data": {"image": [generated(112, 112, seed=i)]},
        }
        for i in range(12)
    ]
    params = SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=1,
        logprobs=2,
        max_tokens=6,
        min_tokens=2,
        ignore_eos=True,
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert runner.upload.capacity == capacity
    llm.shutdown()
