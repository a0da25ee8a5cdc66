"""Which images the scheduler sends to the vision encoder, and when it lets them go.

Images are scheduled like tokens (see ``scheduler.py``): these functions decide, for one
request's window of tokens, which of its images to encode within the step's encoder budget and
the encoder cache's space, and release the images whose placeholder ranges are computed.
"""

from __future__ import annotations

from mm_serve.cache.encoder_cache_manager import EncoderCacheManager
from mm_serve.config import SchedulerConfig
from mm_serve.messages.request import Request


def check_images_fit(config: SchedulerConfig, request: Request) -> None:
    """Every image must fit the encoder budget and cache (and, with ``whole_images``, one
    step's token budget); without chunked prefill, all of a prompt's images must fit one
    step's encoder budget.

    Raises:
        ValueError: naming the tokens needed and the budget.
    """
    budget = min(config.max_num_encoder_input_tokens, config.encoder_cache_size)
    lengths = [f.placeholder.length for f in request.mm_features]
    if not config.enable_chunked_prefill:
        lengths.append(sum(lengths))
    if lengths and max(lengths) > budget:
        raise ValueError(
            f"The prompt's images need {max(lengths)} encoder tokens in one step, above the "
            f"encoder budget of {budget} tokens (max_num_encoder_input_tokens, "
            "encoder_cache_size)."
        )
    if config.whole_images and lengths and max(lengths) > config.max_num_batched_tokens:
        raise ValueError(
            f"An image of the prompt takes {max(lengths)} tokens, which this model computes "
            f"in one step, above max_num_batched_tokens={config.max_num_batched_tokens}."
        )


def schedule_encoder_inputs(
    cache: EncoderCacheManager,
    request: Request,
    num_computed: int,
    num_new: int,
    encoder_budget: int,
    whole_images: bool = False,
) -> tuple[list[int], int]:
    """Which of ``request``'s images to encode for the window
    ``[num_computed, num_computed + num_new)``, and the window's (possibly cut) length.

    An image is skipped when its range lies before ``num_computed`` (its KV exists, e.g. a
    prefix-cache hit) or its embeddings are cached (the request then references them). The
    first image that does not fit the encoder budget or cache cuts the window just before
    it (to 0 tokens when the window starts inside that image). With ``whole_images``, a
    window that would end inside an image ends before it instead (to 0 tokens when it starts
    inside that image or at its start).
    """
    if whole_images:
        num_new = _end_before_cut_image(request, num_computed, num_new)
    to_encode: list[int] = []
    chosen: set[str] = set()
    pending = 0  # encoder tokens chosen for this request, not yet allocated
    for input_id, feature in enumerate(request.mm_features):
        start, length = feature.placeholder.offset, feature.placeholder.length
        if start >= num_computed + num_new:
            break  # mm_features are in prompt order
        if start + length <= num_computed or feature.mm_hash in chosen:
            continue
        if cache.check_and_update_cache(request, input_id):
            continue
        if not cache.can_allocate(length, encoder_budget - pending, pending):
            num_new = max(0, start - num_computed)
            break
        to_encode.append(input_id)
        chosen.add(feature.mm_hash)
        pending += length
    return to_encode, num_new


def _end_before_cut_image(request: Request, num_computed: int, num_new: int) -> int:
    """``num_new``, or less so that ``[num_computed, num_computed + num_new)`` ends before an
    image it would otherwise end inside."""
    end = num_computed + num_new
    for feature in request.mm_features:  # in prompt order
        start = feature.placeholder.offset
        if start >= end:
            break
        if end < feature.placeholder.end:
            return max(0, start - num_computed)
    return num_new


def free_consumed_encoder_inputs(
    cache: EncoderCacheManager, request: Request, num_scheduled: int
) -> None:
    """Release the images whose whole range is now computed (their KV holds them); none can
    newly be once a step began past the prompt, where every image lies (a decode step)."""
    if request.num_computed_tokens - num_scheduled >= len(request.prompt_token_ids):
        return
    for input_id in cache.get_cached_input_ids(request):
        if request.mm_features[input_id].placeholder.end <= request.num_computed_tokens:
            cache.free_encoder_input(request, input_id)
