"""Prompt processing: prompts and chat messages in, validated engine ``Request``s out.

``InputProcessor.process`` tokenizes a prompt and submits its images to the multimodal
processor, returning a ``PendingPrompt`` at once; its ``result()`` waits for the images. No
asyncio here: the offline API calls it directly, a server from a worker thread.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

from mm_serve.checkpoint.hub import eos_token_ids
from mm_serve.config import ModelConfig, MultiModalConfig
from mm_serve.config.lora import LoRAConfig
from mm_serve.frontend.chat_media import split_chat_media
from mm_serve.frontend.exceptions import InvalidParamError
from mm_serve.frontend.mm_processor import MultiModalProcessor, PendingImages
from mm_serve.lora.request import LoRAAdapterError, LoRARequest
from mm_serve.messages.pooling_params import PoolingParams
from mm_serve.messages.request import MultiModalFeature, Request, check_image_tokens
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.messages.structured_outputs import check_grammar

logger = logging.getLogger(__name__)

# A pooling request's (``Request``): one step past its prompt for the length bookkeeping.
POOLING_SAMPLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)

# A prompt as users give it (vLLM's forms): text, {"prompt": text}, or {"prompt_token_ids":
# [...]}; VLMs add "multi_modal_data": {"image": [...], "video": [...]} and optionally
# "multi_modal_uuids": {"image": [...], "video": [...]}, vLLM's "mm_processor_kwargs" (dict:
# ``ImageProcessor.with_kwargs``, ``VideoProcessor.with_kwargs``) and mm_serve's
# "multi_modal_detail": {"image": [...]} (each image's OpenAI detail, or None); any prompt may
# carry a "cache_salt" (str) that keeps its KV blocks from being shared.
# ``Prompt.parse`` checks it and makes it a ``Prompt``.
PromptType = str | dict[str, Any]

_PROMPT_KEYS = (
    "prompt", "prompt_token_ids", "multi_modal_data", "multi_modal_uuids", "cache_salt",
    "mm_processor_kwargs", "multi_modal_detail",
)  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    """A prompt, typed: what ``Prompt.parse`` makes of a ``PromptType``."""

    text: str | None = None
    token_ids: list[int] | None = None  # None: tokenize ``text``
    images: list[Any] | None = None  # None: no images (not even an empty list)
    image_uuids: list[str | None] | None = None  # None: images identified by their content
    cache_salt: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # None: the server's
    image_details: list[str | None] | None = None  # None: the server's detail for every image
    videos: list[Any] | None = None  # None: no videos
    video_uuids: list[str | None] | None = None  # None: videos identified by their content

    @classmethod
    def parse(cls, prompt: PromptType | Prompt) -> Prompt:
        """Raises ValueError: not a str, dict or ``Prompt``; unknown keys; a cache_salt that is
        not a str, mm_processor_kwargs that are not a dict; neither "prompt" nor
        "prompt_token_ids"."""
        if isinstance(prompt, (str, Prompt)):
            return cls(text=prompt) if isinstance(prompt, str) else prompt
        if not isinstance(prompt, dict):
            raise ValueError(f"A prompt must be a str or a dict, not {type(prompt).__name__}.")
        unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
        if unknown:
            raise ValueError(f"Unknown prompt keys {unknown}; expected some of {_PROMPT_KEYS}.")
        cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a str.")
        mm_kwargs = prompt.get("mm_processor_kwargs")
        if mm_kwargs is not None and not isinstance(mm_kwargs, dict):
            raise ValueError("mm_processor_kwargs must be a dict.")
        if "prompt" not in prompt and "prompt_token_ids" not in prompt:
            raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        token_ids = prompt.get("prompt_token_ids")
        data, ids = prompt.get("multi_modal_data") or {}, prompt.get("multi_modal_uuids") or {}
        for name, value in (("multi_modal_data", data), ("multi_modal_uuids", ids)):
            unknown = sorted(set(value) - {"image", "video"}) if isinstance(value, dict) else []
            if not isinstance(value, dict) or unknown:
                raise ValueError(f"{name} must be a dict with 'image' and/or 'video' keys.")
        images, videos = data.get("image"), data.get("video")
        uuids, video_uuids = ids.get("image"), ids.get("video")
        details = (prompt.get("multi_modal_detail") or {}).get("image")
        return cls(
            text=prompt.get("prompt"),
            token_ids=None if "prompt_token_ids" not in prompt else list(token_ids),
            images=None if images is None else _as_list(images),
            image_uuids=None if uuids is None else _as_list(uuids),
            cache_salt=cache_salt,
            mm_processor_kwargs=mm_kwargs,
            image_details=None if details is None else _as_list(details),
            videos=None if videos is None else _as_videos(videos),
            video_uuids=None if video_uuids is None else _as_list(video_uuids),
        )


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _as_videos(value: Any) -> list[Any]:
    """``multi_modal_data["video"]`` → a list of videos, as vLLM reads it: a file (bytes or a
    path), an array of ``ndim`` 4, a ``(frames, metadata)`` pair or a list of frames (PIL
    images, 3-d arrays) is one video; any other list or tuple is a list of videos."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        return [value]
    if not isinstance(value, (list, tuple)):
        return [value]
    frame_like = [
        getattr(v, "ndim", None) == 3 or type(v).__module__.startswith("PIL") for v in value
    ]
    return [list(value)] if value and all(frame_like) else list(value)


@dataclass
class ProcessedPrompt:
    """A prompt ready for the engine: placeholders expanded, one feature per image."""

    text: str | None
    token_ids: list[int]
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    cache_salt: str | None = None


@dataclass
class PendingPrompt:
    """A tokenized prompt whose images may still be in the preprocessing pool.

    ``done()`` says whether ``result()`` would return without waiting.
    """

    model_config: ModelConfig
    text: str | None
    token_ids: list[int]
    cache_salt: str | None
    images: PendingImages | None

    def done(self) -> bool:
        return self.images is None or self.images.done()

    def result(self) -> ProcessedPrompt:
        """Wait for the images, expand their placeholders and check the final length.

        Raises:
            ValueError: an image failed to preprocess, the expanded prompt leaves no room
                for output within ``max_model_len``, or image tokens that no image fills.
        """
        token_ids, features = self.token_ids, []
        if self.images is not None:
            token_ids, features = self.images.result()
            check_token_ids(token_ids, self.model_config)
        model = self.model_config
        check_image_tokens(token_ids, features, model.image_token_id, model.video_token_id)
        return ProcessedPrompt(self.text, token_ids, features, self.cache_salt)


def check_token_ids(token_ids: list[int], model_config: ModelConfig) -> None:
    """Raises ValueError for an empty prompt, one that leaves no room for an output token
    within ``max_model_len``, or token ids outside the vocabulary."""
    if not token_ids:
        raise ValueError("The prompt is empty.")
    max_len = model_config.max_model_len
    if len(token_ids) >= max_len:
        raise ValueError(
            f"The prompt has {len(token_ids)} tokens, but the model's maximum length is "
            f"{max_len} (prompt and at least one output token)."
        )
    vocab_size = model_config.vocab_size
    if bad := [t for t in token_ids if not 0 <= t < vocab_size]:
        raise ValueError(
            f"Prompt token ids must be in [0, {vocab_size}): {bad} are out of vocabulary."
        )


def check_sampling_params(params: SamplingParams, vocab_size: int) -> None:
    """What ``SamplingParams`` cannot check alone: ``logit_bias`` ids in the vocabulary, and a
    ``structured_outputs`` constraint that compiles.

    Raises:
        InvalidParamError: naming ``logit_bias`` or ``structured_outputs``.
    """
    if bad := [token for token in params.logit_bias or {} if not 0 <= token < vocab_size]:
        message = (
            f"logit_bias token ids must be in [0, {vocab_size}): {bad} are out of vocabulary "
            f"(vocabulary size {vocab_size})."
        )
        raise InvalidParamError("logit_bias", message)
    if params.structured_outputs is not None:
        try:
            check_grammar(params.structured_outputs)
        except ValueError as e:
            raise InvalidParamError("structured_outputs", str(e)) from None


def resolve_pooling_params(params: PoolingParams, model_config: ModelConfig) -> PoolingParams:
    """``params`` completed from the model's pooler config (``pooling_type``, and
    ``normalize`` unless set), after vLLM's checks of ``dimensions``.

    Raises:
        InvalidParamError: naming ``dimensions``: set for a model not trained for Matryoshka
            truncation, not one of its ``matryoshka_dimensions``, or outside
            ``[1, hidden_size]``.
    """
    config, dimensions = model_config.pooler_config, params.dimensions
    if dimensions is not None:
        hidden_size = model_config.text_config.hidden_size
        if not config.is_matryoshka:
            message = "the model does not support Matryoshka dimensions; leave dimensions unset."
        elif config.matryoshka_dimensions and dimensions not in config.matryoshka_dimensions:
            message = f"dimensions must be one of {list(config.matryoshka_dimensions)}."
        elif not 1 <= dimensions <= hidden_size:
            message = f"dimensions must be in [1, {hidden_size}]."
        else:
            message = None
        if message is not None:
            raise InvalidParamError("dimensions", f"Invalid dimensions {dimensions}: {message}")
    normalize = config.normalize if params.normalize is None else params.normalize
    return dataclasses.replace(params, normalize=normalize, pooling_type=config.pooling_type)


def load_tokenizer(path: str):
    """The fast tokenizer of the folder ``path``, with the chat template ``AutoProcessor``
    would use (``processor_config.json``, ``chat_template.json``, then ``chat_template.jinja``;
    see ``read_chat_template``), else its own (from ``tokenizer_config.json``).

    Raises:
        ValueError: the tokenizer has no fast version, or a processor file is malformed.
    """
    from transformers import AutoTokenizer

    from mm_serve.encoders.processors import read_chat_template

    tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"The tokenizer at {path} has no fast (Rust) version; one is required.")
    chat_template = read_chat_template(path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


class InputProcessor:
    """Tokenizes prompts, applies the chat template and builds engine requests.

    Stop tokens: the tokenizer's EOS is the request's ``eos_token_id``; further EOS ids of the
    checkpoint's ``generation_config.json`` (e.g. Llama 3's ``<|eot_id|>``) are added to the
    request's ``stop_token_ids``, as vLLM does, so generation ends where HF ``generate`` ends.

    Needs no event loop (a server calls it from a worker thread). For a VLM it owns the
    preprocessing pool, through its thread-safe ``MultiModalProcessor``: call ``shutdown()``
    when done.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        mm_config: MultiModalConfig,
        tokenizer,
        generation_config,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.model_config = model_config
        # Checks adapters before their first request (None: LoRA off). Imported only with
        # LoRA: it reads the model's layers (on meta), which a server without LoRA never loads.
        self.lora = None
        if lora_config is not None:
            from mm_serve.lora.registry import LoRARegistry

            self.lora = LoRARegistry(model_config, lora_config)
        self.tokenizer = tokenizer
        self.mm_processor = None
        if model_config.image_token_id is not None:
            self.mm_processor = MultiModalProcessor(model_config, mm_config)
        self.eos_token_id = tokenizer.eos_token_id
        self.stop_token_ids = eos_token_ids(tokenizer.eos_token_id, generation_config)
        self.extra_stop_token_ids = [t for t in self.stop_token_ids if t != self.eos_token_id]

    def process(
        self, prompt: PromptType | Prompt, add_special_tokens: bool = True
    ) -> PendingPrompt:
        """Tokenize a prompt (a text one with the tokenizer's special tokens, e.g. BOS, unless
        ``add_special_tokens`` is False) and start preprocessing its images; returns without
        waiting for the preprocessing pool (call ``result()`` on the returned prompt).

        Raises:
            ValueError: on a malformed prompt (``Prompt.parse``), an empty one, images for a
                text-only model, images and placeholders (or uuids) that differ in number,
                token ids outside the vocabulary, or a prompt that leaves no room for output
                within ``max_model_len``. Errors found while preprocessing (an undecodable
                image, one above ``max_pixels``, the length after expansion) are raised by
                ``result()``.
        """
        prompt = Prompt.parse(prompt)
        token_ids = prompt.token_ids
        if token_ids is None:
            text = self._text_to_tokenize(prompt.text)
            token_ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        # Placeholders only grow on expansion: a prompt too long already fails here.
        check_token_ids(token_ids, self.model_config)
        pending = None
        if prompt.images is not None or prompt.videos is not None:
            if self.mm_processor is None:
                raise ValueError(
                    f"The model {self.model_config.model!r} is text-only and takes no images."
                )
            pending = self.mm_processor.submit(
                token_ids,
                prompt.images or [],
                prompt.image_uuids,
                prompt.mm_processor_kwargs,
                prompt.image_details,
                prompt.videos,
                prompt.video_uuids,
            )
        return PendingPrompt(self.model_config, prompt.text, token_ids, prompt.cache_salt, pending)

    def _text_to_tokenize(self, text: str) -> str:
        """The prompt text as the family's processor tokenizes it (``ImageProcessor.
        prompt_text``: Gemma 3's newlines around image placeholders)."""
        return text if self.mm_processor is None else self.mm_processor.processor.prompt_text(text)

    def shutdown(self) -> None:
        """Stop the preprocessing pool's processes, if any were started."""
        if self.mm_processor is not None:
            self.mm_processor.shutdown()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> dict[str, Any]:
        """Render a conversation with ``chat_template`` (else the engine's ``chat_template``
        option, else the checkpoint's) into a prompt dict. ``chat_template_kwargs`` (vLLM's)
        and ``template_kwargs`` are further variables of the template (e.g. Qwen3's
        ``enable_thinking``).

        Image parts (``image_url`` with a data/file URL or path, or ``image``) and video parts
        (``video_url``, ``video``) become the template's image and video placeholders and the
        prompt's ``multi_modal_data``; their ``uuid`` keys its ``multi_modal_uuids``, an
        ``image_url``'s ``detail`` its ``multi_modal_detail`` (``chat_media.split_chat_media``).
        BOS is added as HF's processors do, unless the template already wrote it (no double
        BOS); ``add_special_tokens`` adds the tokenizer's special tokens regardless (vLLM's).

        Raises:
            InvalidParamError: a ``chat_template_kwargs`` key that the rendering sets itself
                (``messages``, ``add_generation_prompt``, ``tokenize``, ...).
        """
        template_kwargs |= self._checked_template_kwargs(chat_template_kwargs or {})
        messages, media = split_chat_media(messages)
        text = self.tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template or self.model_config.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **template_kwargs,
        )
        bos = self.tokenizer.bos_token
        add_special_tokens = add_special_tokens or not (bos and text.startswith(bos))
        tokenized = self._text_to_tokenize(text)
        token_ids = self.tokenizer(tokenized, add_special_tokens=add_special_tokens).input_ids
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids}
        return prompt | media.multi_modal_fields()

    def _checked_template_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` unless one of them is set by the rendering (an argument of the
        tokenizer's ``apply_chat_template``, or a variable it passes the template)."""
        signature = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        reserved = {p.name for p in signature if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        taken = sorted(set(kwargs) & (reserved | {"messages", "tools", "documents"}))
        if taken:
            raise InvalidParamError(
                "chat_template_kwargs",
                f"chat_template_kwargs may not set {taken}: the request's own fields do.",
            )
        return kwargs

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> list[Request]:
        """One engine request per completion (``n``); child ``i`` is ``{i}_{request_id}``,
        all with the adapter ``lora_request`` (None: the base model).

        Children share the prompt's KV blocks through the prefix cache, and its cache_salt. A
        seeded request's child ``i`` uses seed ``seed + i`` so the ``n`` samples differ but are
        reproducible.

        Raises:
            ValueError: a ``logit_bias`` id outside the vocabulary, or a ``structured_outputs``
                constraint that does not compile (the compiler's message).
            LoRAAdapterError: the adapter cannot be served, or LoRA is off.
        """
        check_sampling_params(params, self.model_config.vocab_size)
        features = self._features_for(prompt.mm_features, lora_request)
        stop_token_ids = params.stop_token_ids + [
            t for t in self.extra_stop_token_ids if t not in params.stop_token_ids
        ]
        shared = {"mm_features": features, "cache_salt": prompt.cache_salt}
        shared["lora_request"] = lora_request
        requests = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child = dataclasses.replace(params, n=1, seed=seed, stop_token_ids=stop_token_ids)
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            requests.append(Request(child_id, prompt.token_ids, child, self.eos_token_id, **shared))
        return requests

    def make_pooling_request(
        self, request_id: str, prompt: ProcessedPrompt, params: PoolingParams
    ) -> Request:
        """The engine request of one embedding (the pooling runner), ``params`` completed by
        ``resolve_pooling_params`` (an ``InvalidParamError`` naming ``dimensions``)."""
        return Request(
            request_id,
            prompt.token_ids,
            POOLING_SAMPLING_PARAMS,
            mm_features=prompt.mm_features,
            cache_salt=prompt.cache_salt,
            pooling_params=resolve_pooling_params(params, self.model_config),
        )

    def _features_for(
        self, features: list[MultiModalFeature], lora_request: LoRARequest | None
    ) -> list[MultiModalFeature]:
        """The request's images as its adapter sees them (``LoRARegistry.features_for``)."""
        if lora_request is None:
            return features
        self.check_lora_request(lora_request)
        return self.lora.features_for(features, lora_request)

    def check_lora_request(self, lora_request: LoRARequest) -> None:
        """Raises LoRAAdapterError when LoRA is off or the adapter cannot be served
        (``LoRARegistry.check``; each adapter is read once)."""
        if self.lora is None:
            raise LoRAAdapterError("LoRA adapters need an engine started with enable_lora.")
        self.lora.check(lora_request)
