"""The start-up warm-up: prompts through every stage before the server says ready.

Much of a first request's time is one-off work: Pillow's plugins, torch's kernels and
allocator, the chat template's compilation, the vision tower's first call. Start-up pays it
with warm-up requests (``AsyncLLM.warm_up``; ``LLM`` on CUDA): chat template, tokenizer,
preprocessing workers, the vision encoder, prefill and decode steps, detokenization. On CUDA
they are a batch that fills the largest step (``warm_up_batch_size``), elsewhere one request.
The first user's answer then comes as fast as the next one, and finds no trace of them:
``EngineCore.reset`` drops their prefix- and encoder-cache entries and counts, and the server's
metrics never hear of them. Only the front end's processor cache keeps their images, under
fresh uuids that no user image matches, and counts their lookups (one miss each).
"""

from __future__ import annotations

import uuid
from typing import Any

from mm_serve.config import EngineConfig
from mm_serve.frontend.processor import InputProcessor
from mm_serve.messages.pooling_params import PoolingParams
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.preprocess.pool import warm_up_image

# A prefill and one decode step, whatever the model says first.
WARM_UP_PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
WARM_UP_QUESTION = "Describe the image."
# On CUDA the warm-up is a batch of photo-sized images (448x448: 256 Qwen2-VL tokens).
BATCH_IMAGE_SIZE = 448


def warm_up_params(config: EngineConfig) -> SamplingParams | PoolingParams:
    """``WARM_UP_PARAMS``; under the pooling runner, an embedding (its prompt's steps)."""
    return PoolingParams() if config.model.runner == "pooling" else WARM_UP_PARAMS


def warm_up_image_size(config: EngineConfig) -> int:
    """The warm-up images' side in pixels: ``BATCH_IMAGE_SIZE`` on CUDA, else ``warm_up_image``'s
    default (a single small request is all a CPU start needs)."""
    return BATCH_IMAGE_SIZE if config.device.type == "cuda" else 224


def warm_up_batch_size(config: EngineConfig, prompt_len: int) -> int:
    """How many warm-up prompts of ``prompt_len`` tokens start-up sends at once.

    On CUDA: enough to fill the first step's token budget (``max_num_batched_tokens``) and leave
    a decode batch behind, within ``max_num_seqs``. The largest step then runs before the first
    user's: the vision tower on the most images a step encodes, the LM on the most tokens, every
    kernel variant those sizes select compiled, the caching allocators and the pinned host
    buffers grown to their size, so that the first user's large batch runs as fast as the
    next. Elsewhere one prompt: there is nothing to compile.
    """
    if config.device.type != "cuda":
        return 1
    scheduler = config.scheduler
    fill = -(-scheduler.max_num_batched_tokens // max(prompt_len, 1)) + 1
    return max(1, min(scheduler.max_num_seqs, fill))


def warm_up_prompt(input_processor: InputProcessor, image_size: int = 224) -> dict[str, Any]:
    """For a VLM: ``warm_up_image(image_size)`` and a question, in the checkpoint's chat
    template; for a text model, the question alone. Without a chat template, the image's
    placeholder tokens (framed by the vision start and end tokens where the model has them) as
    token ids.

    The image carries a fresh uuid, so no user image ever shares its cache entries.
    """
    hf_config = input_processor.model_config.hf_config
    image_id = input_processor.model_config.image_token_id
    if image_id is None:
        content: Any = WARM_UP_QUESTION
    else:
        image_uuid = f"mm_serve-warm-up-{uuid.uuid4().hex}"
        image_part = {"type": "image", "image": warm_up_image(image_size), "uuid": image_uuid}
        content = [image_part, {"type": "text", "text": WARM_UP_QUESTION}]
    try:
        return input_processor.apply_chat_template([{"role": "user", "content": content}])
    except ValueError:  # transformers: the tokenizer has no chat template
        if image_id is None:
            return {"prompt": WARM_UP_QUESTION}
    names = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
    token_ids = [getattr(hf_config, name, None) for name in names]
    token_ids[1] = image_id
    return {
        "prompt_token_ids": [t for t in token_ids if t is not None],
        "multi_modal_data": {"image": [image_part["image"]]},
        "multi_modal_uuids": {"image": [image_uuid]},
    }
