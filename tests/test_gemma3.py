"""Gemma 3 against HF transformers on a tiny checkpoint (``testing.gemma3_checkpoint``: a
12-token sliding window, four KV-cache groups, 9 image tokens per image).

The processor: our pixels equal ``Gemma3ImageProcessor``'s for a photograph, an odd size and
a grayscale image, and our prompt ids ``Gemma3Processor``'s (newlines around each image,
merged with the text's). The engine: greedy tokens and top-5 log-probs equal HF ``generate``'s
for a batch mixing a text-only prompt longer than the window, a photograph, two odd-sized
images in one prompt and a grayscale image, whole and with a token budget of 12 (its chunks
end between images, never inside one); a long request frees the sliding groups' blocks
outside the window as it goes; prefix-cache hits (one inside an image) stay correct. First,
that the two masks matter at all on this checkpoint: HF's output changes without them.
"""

from __future__ import annotations

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.messages.request import Request
from tests.fixtures import family_checks as checks
from tests.fixtures.hf_reference import hf_greedy_generate
from tests.fixtures.images import Case, generated, mixed_batch, photo, processor_images
from tests.fixtures.leaks import assert_llm_idle

MAX_NEW_TOKENS = checks.MAX_NEW_TOKENS
LONG_TEXT = (
    "A text-only question about the harbor town, the fishing boats and the gulls, long "
    "enough to run past the sliding window several times over."
)


def cases() -> list[Case]:
    return mixed_batch(
        text_only=LONG_TEXT,
        describe="Describe this image:<start_of_image>",
        compare="Compare <start_of_image> with <start_of_image> please.",
        several=[generated(301, 87, 1), generated(23, 45, 2)],
        what="<start_of_image>\nWhat is here?",
    )


path, reference = checks.checkpoint_fixtures("gemma3", seed=3)


@pytest.mark.parametrize("image", processor_images().values(), ids=processor_images().keys())
def test_processor_matches_hf(path, reference, image):
    processor = reference.processor
    text = "Look:\n<start_of_image>Describe."
    hf = reference.inputs(text, [image])
    ours = checks.image_processor(path)
    item = ours.preprocess(image)
    assert torch.equal(item.pixel_values, hf["pixel_values"][0])
    ids = processor.tokenizer(ours.prompt_text(text))["input_ids"]
    at = ids.index(processor.tokenizer.boi_token_id)
    assert ids[:at] + list(item.token_ids) + ids[at + 1 :] == hf["input_ids"][0].tolist()
    # The "\n" before the image and HF's "\n\n" are one token, as in Gemma's vocabulary.
    (three_newlines,) = processor.tokenizer("\n\n\n", add_special_tokens=False)["input_ids"]
    assert three_newlines in ids
    assert item.num_tokens == len(item.token_ids) == ours.max_num_tokens == 11


def test_masks_matter_on_this_checkpoint(reference):
    """HF's logits change without the image tokens' bidirectional mask (no token types) and
    with a window longer than the prompt: equality with HF below tests both."""
    model = reference.model
    image_case = reference.inputs(*cases()[1])
    with torch.inference_mode():
        full = model(**image_case).logits
        no_types = {k: v for k, v in image_case.items() if k != "token_type_ids"}
        assert (model(**no_types).logits - full).abs().max() > 1e-3
        text = reference.inputs(LONG_TEXT)
        windowed = model(**text).logits
        model.config.text_config.sliding_window = 4096
        try:
            assert (model(**text).logits - windowed).abs().max() > 1e-3
        finally:
            model.config.text_config.sliding_window = 12


def record_chunks(llm: LLM) -> list[tuple[Request, int, int]]:
    """``(request, start, end)`` of every prefill chunk the engine schedules from now on."""
    scheduler = llm.engine_core.scheduler
    chunks, schedule = [], scheduler.schedule

    def recording_schedule():
        output = schedule()
        for req_id, num in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            if request.num_computed_tokens <= request.num_prompt_tokens:
                chunks.append(
                    (request, request.num_computed_tokens - num, request.num_computed_tokens)
                )
        return output

    scheduler.schedule = recording_schedule
    return chunks


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 12, "block_size": 4},
        {"max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 90},
    ],
    ids=["whole", "chunked", "preempted"],
)
def test_greedy_matches_hf(path, reference, engine_args):
    with checks.running_llm(path, **engine_args) as llm:
        chunks = record_chunks(llm)
        checks.assert_matches_hf(llm, reference, cases())
        if "num_kv_blocks" in engine_args:
            # Again, the images now in the processor cache: every prompt is added before the
            # first step, so they contend for the blocks however slowly the pool ran before.
            checks.assert_matches_hf(llm, reference, cases())
        preemptions = llm.engine_core.scheduler.num_preemptions
    assert (preemptions > 0) == ("num_kv_blocks" in engine_args)
    cut_before_image = 0
    for request, start, end in chunks:
        for feature in request.mm_features:
            image = feature.placeholder
            assert not image.offset < end < image.end, (start, end, image)
            cut_before_image += end == image.offset and end - start < 12
    if not engine_args:
        assert len(chunks) == len(cases())  # one chunk per prompt
    else:
        assert cut_before_image > 0  # chunks that end early, before an image


def test_blocks_outside_the_window_are_freed(path, reference):
    """A long prompt and decode in 8-token chunks: each sliding-window group holds only the
    blocks of the window and the chunk, the full-attention group all; HF's tokens."""
    with checks.running_llm(path, max_num_batched_tokens=8, block_size=4) as llm:
        core = llm.engine_core
        kv = core.scheduler.kv_cache_manager
        windows = [getattr(policy, "sliding_window", None) for policy in kv.policies]
        assert kv.num_groups == 4 and windows == [None, 12, 12, 12]
        prompt_ids, ref_tokens, _ = reference.greedy(LONG_TEXT)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
        request = Request("long", prompt_ids, params)  # no EOS: HF's tokens are a prefix
        core.add_request(request)
        held_most = full_most = 0
        while core.has_unfinished_requests():
            start = request.num_computed_tokens  # the step's first token: its window's blocks
            core.step()
            groups = kv.req_to_blocks.get("long")
            if groups is None:
                continue
            assert len(groups[0]) == -(-request.num_computed_tokens // 4)  # every block
            first_needed = max(0, start - 12 + 1) // 4
            for blocks in groups[1:]:
                held = [b for b in blocks if b is not kv.null_block]
                assert held == blocks[first_needed:] and len(held) <= 6
            held_most, full_most = max(held_most, len(held)), len(groups[0])
            assert kv.num_free_blocks == kv.num_blocks - len(groups[0]) - 3 * len(held)
        assert full_most > 2 * held_most  # the request is several windows long
        assert request.output_token_ids[: len(ref_tokens)] == ref_tokens
        assert kv.num_free_blocks == kv.num_blocks
        assert_llm_idle(llm)


def test_prefix_cache_hits_stay_correct(path, reference):
    """The same image prompt twice: the second takes its prefix from the cache, a hit that
    ends inside the image's soft tokens (the rest of the image attends to the cached part),
    and still matches HF; a different image behind the same text does not hit past the text."""
    args = dict(enable_prefix_caching=True, block_size=4, max_num_batched_tokens=16)
    with checks.running_llm(path, **args) as llm:
        image = photo("grace_hopper.jpg")
        case = ("Look at this:<start_of_image>", [image])
        (first,) = checks.assert_matches_hf(llm, reference, [case])
        (second,) = checks.assert_matches_hf(llm, reference, [case])
        boi = first.prompt_token_ids.index(reference.processor.tokenizer.boi_token_id)
        assert boi + 1 < second.num_cached_tokens < boi + 10  # inside the soft tokens
        other = ("Look at this:<start_of_image>", [photo("coffee.png")])
        (third,) = checks.assert_matches_hf(llm, reference, [other])
        assert third.num_cached_tokens <= boi
        (text_first,) = checks.assert_matches_hf(llm, reference, [cases()[0]])
        (text_again,) = checks.assert_matches_hf(llm, reference, [cases()[0]])
        assert text_again.num_cached_tokens >= len(text_again.prompt_token_ids) - 4
        assert text_first.outputs[0].token_ids == text_again.outputs[0].token_ids


def test_chat_with_image_part(path, reference):
    """A chat turn whose image follows "user\\n": HF's "\\n\\n" merges with that newline, in
    HF's ids and in ours; HF's greedy tokens."""
    messages = checks.user_turn([photo("rocket.jpg")])
    with checks.running_llm(path) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
        (output,) = llm.chat(messages, params, use_tqdm=False)
        inputs = reference.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True,
            return_tensors="pt",
        )  # fmt: skip
        prompt_ids, ref_tokens, _ = hf_greedy_generate(reference.model, inputs, MAX_NEW_TOKENS)
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == ref_tokens
        assert_llm_idle(llm)


def test_gemma_3_4b_architecture(tmp_path):
    """The dummy-weight folder of Gemma-3-4B has the published sizes, and the engine reads
    them: 258 placeholder tokens per image, 7 KV-cache groups of 5 layers (29 sliding-window
    layers of 1,024 tokens, 5 full), whole images in prefill chunks."""
    from transformers import AutoConfig

    from mm_serve.cache.kv_cache_groups import kv_cache_layout
    from mm_serve.config import EngineArgs
    from tests.fixtures.checkpoints import write_architecture

    folder = write_architecture("gemma-3-4b", tmp_path)
    config = AutoConfig.from_pretrained(folder)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (2560, 10240, 34)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (8, 4, 256)
    assert (text.vocab_size, text.sliding_window, text.query_pre_attn_scalar) == (262208, 1024, 256)
    assert text.rope_parameters["full_attention"] == {
        "rope_type": "linear", "factor": 8.0, "rope_theta": 1e6
    }  # fmt: skip
    assert text.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert (vision.hidden_size, vision.num_hidden_layers, vision.image_size) == (1152, 27, 896)
    engine = EngineArgs(model=folder, device="cpu", load_format="dummy").create_engine_config()
    assert engine.multimodal.max_image_tokens == 258 and engine.scheduler.whole_images
    assert engine.model.image_token_id == config.boi_token_index
    layout = kv_cache_layout(config)
    assert layout.num_groups == 7 and layout.layers_per_group == 5
