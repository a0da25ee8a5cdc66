"""The start-up warm-up request: one prompt through every stage before the server says ready.

Much of a first request's time is one-off work: Pillow's plugins, torch's kernels and
allocator, the chat template's compilation, the vision tower's first call. Start-up pays it
with this request (``AsyncLLM.warm_up``): chat template, tokenizer, a preprocessing worker,
the vision encoder, a prefill and a decode step, detokenization. The first user's answer then
comes as fast as the next one, and finds no trace of it: ``EngineCore.reset`` drops its prefix-
and encoder-cache entries and counts, and the server's metrics never hear of it. Only the
front end's processor cache keeps its image, under a fresh uuid that no user image matches,
and counts its lookup (one miss).
"""

from __future__ import annotations

import uuid
from typing import Any

from mm_serve.engine.mm_processor import image_token_id
from mm_serve.engine.preprocess_pool import warm_up_image
from mm_serve.engine.processor import InputProcessor
from mm_serve.sampling_params import SamplingParams

# A prefill and one decode step, whatever the model says first.
WARM_UP_PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
WARM_UP_QUESTION = "Describe the image."


def warm_up_prompt(input_processor: InputProcessor) -> dict[str, Any]:
    """For a VLM: ``warm_up_image()`` and a question, in the checkpoint's chat template; for a
    text model, the question alone. Without a chat template, the image's placeholder tokens
    (framed by the vision start and end tokens where the model has them) as token ids.

    The image carries a fresh uuid, so no user image ever shares its cache entries.
    """
    hf_config = input_processor.model_config.hf_config
    image_id = image_token_id(hf_config)
    if image_id is None:
        content: Any = WARM_UP_QUESTION
    else:
        image_uuid = f"mm_serve-warm-up-{uuid.uuid4().hex}"
        image_part = {"type": "image", "image": warm_up_image(), "uuid": image_uuid}
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
