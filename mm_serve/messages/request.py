"""Engine-side state of one request: tokens, progress, status and multimodal features."""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from mm_serve.lora.request import LoRARequest
from mm_serve.messages.pooling_params import PoolingParams
from mm_serve.messages.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished (``Request.is_finished``).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()


# The last unfinished status, as a plain module constant: ``Request.is_finished`` runs for
# every request every step, and an enum class attribute costs several times a global lookup.
LAST_UNFINISHED = int(RequestStatus.PREEMPTED)

# The OpenAI ``finish_reason`` of each finished status (``.get``: None while unfinished).
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True)
class PlaceholderRange:
    """Where a multimodal item's embeddings sit in the prompt: tokens [offset, offset+length)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultiModalFeature:
    """One image or video of a request: its content hash, its placeholder range and (later)
    its data (a ``ProcessedImage``, whose ``modality`` says which).

    ``mm_hash`` identifies the content (``cache/mm_hash.py``); it keys the
    encoder cache and enters the prefix-cache hash of every KV block the range overlaps.
    """

    mm_hash: str
    placeholder: PlaceholderRange
    data: Any = None  # preprocessed pixels, filled by the multimodal processor


def check_image_tokens(
    token_ids: list[int],
    features: list[MultiModalFeature],
    image_token: int | None,
    video_token: int | None = None,
) -> None:
    """Raises ValueError when the prompt holds image (or video) tokens that no image (or
    video) fills (its text may spell the placeholder without passing one; the model cannot run
    that)."""
    for token, modality in ((image_token, "image"), (video_token, "video")):
        if token is None:
            continue
        filled = sum(_num_tokens(f, token) for f in features if _modality(f) == modality)
        if token_ids.count(token) != filled:
            raise ValueError(
                f"The prompt contains {modality} placeholder tokens that no {modality} fills; "
                f"pass {modality}s as {modality} parts (or multi_modal_data), not as "
                "placeholder text."
            )


def _modality(feature: MultiModalFeature) -> str:
    return getattr(feature.data, "modality", "image")


def _num_tokens(feature: MultiModalFeature, token: int) -> int:
    """Placeholder tokens in ``feature``'s range: all of it, unless its item has its own
    ``token_ids`` (Idefics3: tile tags and newlines among them)."""
    token_ids = getattr(feature.data, "token_ids", None)
    if token_ids is None:
        return feature.placeholder.length
    return token_ids.count(token)


@dataclass(slots=True)
class Request:
    """A request inside the engine core.

    There are no prefill/decode phases: the scheduler only looks at ``num_computed_tokens``
    (tokens whose KV is in the cache, or is being written by a step in flight) against
    ``num_tokens`` (prompt + output so far) plus ``num_output_placeholders`` (tokens a step in
    flight will sample, whose ids the scheduler does not know yet).

    A pooling request (``pooling_params`` set; the pooling runner) carries ``max_tokens=1``
    sampling parameters for this length bookkeeping but samples nothing: the step that
    computes its last prompt token returns its embedding in place of a token, which
    finishes it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower first, with --scheduling-policy priority (vLLM's convention)
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # None: the base model

    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_output_placeholders: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=-1, init=False)  # prefix-cache hit at first schedule
    scheduled_time: float | None = field(default=None, init=False)  # monotonic, first schedule
    # Images whose embeddings this request did not compute (encoder-cache hit, or KV from the
    # prefix cache), set once its whole prompt is first scheduled; -1 until then.
    num_cached_images: int = field(default=-1, init=False)
    encoded_mm_hashes: set[str] = field(default_factory=set, init=False)  # images it encoded
    num_preemptions: int = field(default=0, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    stop_reason: int | str | None = field(default=None, init=False)
    # Prefix-cache hashes of the full blocks of all_token_ids, extended by the KVCacheManager.
    block_hashes: list[Any] = field(default_factory=list, init=False)
    # Structured outputs: its grammar and matcher (``sched/structured_output.RequestGrammar``).
    grammar: Any = field(default=None, init=False)
    max_num_tokens: int = field(init=False)  # see __post_init__
    # The tokens after which the scheduler checks its stop conditions (``stop_token_ids`` and
    # the EOS token unless ignored); the length and a grammar are checked apart.
    stop_check_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("The prompt must contain at least one token.")
        self.all_token_ids = list(self.prompt_token_ids)
        # The length (prompt + output) at which it stops; the scheduler caps it at the model
        # length. One comparison per request per step.
        max_tokens = self.sampling_params.max_tokens
        self.max_num_tokens = len(self.prompt_token_ids) + max_tokens if max_tokens else sys.maxsize
        params = self.sampling_params
        stop_ids = set(params.stop_token_ids or ())
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(self.eos_token_id)
        self.stop_check_token_ids = frozenset(stop_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status > LAST_UNFINISHED

    def count_cached_images(self) -> None:
        """Set ``num_cached_images`` once the whole prompt is scheduled: by then each image was
        either encoded for this request or not needed (cached embeddings or prefix-cached KV)."""
        if self.num_cached_images < 0 and self.num_computed_tokens >= self.num_prompt_tokens:
            encoded = self.encoded_mm_hashes
            self.num_cached_images = sum(f.mm_hash not in encoded for f in self.mm_features)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
