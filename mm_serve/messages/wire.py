"""The messages between the front end and the engine core process (ZeroMQ + msgspec).

Front end → engine (one ZeroMQ multipart message each): frame 0 is the msgpack body of an
``AddRequest``, ``AbortRequests`` or ``UtilityRequest``; an ``AddRequest``'s image tensors
follow as raw frames (frame ``MultiModalFeatureWire.frame``), sent and received without a
copy. The ``n`` engine requests of an ``n > 1`` request share their prompt and images: one
``AddRequest`` carries them all (``siblings``), so each image is sent once. Engine → front
end: one msgpack frame of ``EngineReady``, ``EngineCoreOutputs`` or ``EngineFailed``. Nothing
is pickled: the bodies are typed msgspec structs (``SamplingParams`` and ``EngineStats`` are
plain dataclasses, which msgspec encodes and decodes by field).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from mm_serve.encoders.base import ProcessedImage
from mm_serve.lora.request import LoRARequest
from mm_serve.messages.outputs import EngineCoreOutput
from mm_serve.messages.pooling_params import PoolingParams
from mm_serve.messages.request import MultiModalFeature, PlaceholderRange, Request
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.messages.stats import EngineStats

# Tensor dtypes allowed on the wire, by name (never resolved with getattr on user input).
_WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8,
                torch.int8, torch.int32, torch.int64, torch.bool)  # fmt: skip
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in _WIRE_DTYPES}

Buffer = Any  # anything with the buffer protocol: bytes, memoryview, zmq.Frame


class RequestDecodeError(ValueError):
    """A message from the front end that cannot become engine requests.

    ``request_ids``: the ids it carried (the first request's, then its siblings'), empty when
    not even those could be read.
    """

    def __init__(self, request_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.request_ids = request_ids


# ---- front end → engine ------------------------------------------------------------------


class MultiModalFeatureWire(msgspec.Struct, omit_defaults=True):
    """One image or video of a request; its pixel tensor travels as raw frame ``frame`` (-1:
    none)."""

    mm_hash: str
    offset: int  # placeholder range [offset, offset + length) in the prompt, in tokens
    length: int
    num_tokens: int = 0
    image_grid_thw: tuple[int, int, int] | None = None
    dtype: str = ""  # torch dtype name of the pixel tensor, e.g. "float32"
    shape: tuple[int, ...] = ()
    frame: int = -1
    pixel_mean: tuple[float, ...] = ()  # uint8 pixels: the normalisation left to the engine
    pixel_std: tuple[float, ...] = ()
    token_ids: tuple[int, ...] | None = None  # ``ProcessedImage.token_ids``
    image_size: tuple[int, int] | None = None  # ``ProcessedImage.image_size``
    modality: str = "image"  # ``ProcessedImage.modality``: "image" or "video"
    second_per_grid_t: float | None = None  # a video's seconds per temporal patch


class Sibling(msgspec.Struct, array_like=True):
    """Another engine request of the same user request (``n > 1``): what differs."""

    request_id: str
    sampling_params: SamplingParams


class AddRequest(msgspec.Struct, tag="add", omit_defaults=True):
    """One engine request, and its siblings, which share everything but id and sampling."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.monotonic() of the front end (same host)
    eos_token_id: int | None = None
    cache_salt: str | None = None
    mm_features: list[MultiModalFeatureWire] = []
    siblings: list[Sibling] = []
    priority: int = 0
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None

    @property
    def request_ids(self) -> list[str]:
        return [self.request_id, *(s.request_id for s in self.siblings)]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityRequest(msgspec.Struct, tag="utility"):
    """A call answered by an ``EngineCoreOutputs`` with the same ``call_id``.

    ``method``: "get_stats" (fills ``stats`` and ``kv_cache`` of the answer), "reset",
    "start_profile" or "stop_profile" (``EngineCore``'s; an error fills ``call_error``).
    """

    call_id: int
    method: str


InputMessage = AddRequest | AbortRequests | UtilityRequest


# ---- engine → front end ------------------------------------------------------------------


class RequestError(msgspec.Struct):
    """A request the engine refused or could not run; it is not in the engine any more.

    ``kind``: "invalid_request" (the request's fault: a 4xx) or "internal" (a 5xx).
    """

    request_id: str
    message: str
    kind: str = "invalid_request"


class KVCacheInfo(msgspec.Struct):
    num_blocks: int
    num_free_blocks: int  # includes cached blocks no request holds (evictable)
    block_size: int  # tokens per block


class EngineCoreOutputs(msgspec.Struct, tag="outputs", omit_defaults=True):
    """What one step produced, and/or the answer to a ``UtilityRequest`` (``call_id``).

    ``timestamp``: the engine's ``time.monotonic()`` when the step's outputs were ready (the
    front end copies it into each ``EngineCoreOutput.timestamp``).
    """

    outputs: list[EngineCoreOutput] = []
    timestamp: float | None = None
    errors: list[RequestError] = []
    stats: EngineStats | None = None
    kv_cache: KVCacheInfo | None = None
    call_id: int | None = None
    call_error: str | None = None


class EngineReady(msgspec.Struct, tag="ready"):
    """The start-up handshake: the engine is serving; what the front end needs to know."""

    pid: int
    model: str
    max_model_len: int  # tokens, prompt and output
    vocab_size: int
    num_kv_blocks: int
    block_size: int


class EngineFailed(msgspec.Struct, tag="failed"):
    """The engine could not start (``during_startup``) or its loop died; it exits next."""

    message: str
    traceback: str
    during_startup: bool


OutputMessage = EngineCoreOutputs | EngineReady | EngineFailed


# ---- tensors as raw frames ---------------------------------------------------------------


def tensor_to_buffer(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU-contiguous copy of ``tensor`` (no copy when it already is one)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def tensor_from_buffer(buffer: Buffer, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A tensor viewing ``buffer`` (zero-copy; it keeps the buffer alive).

    Raises:
        ValueError: on an unknown dtype or a buffer whose size does not match the shape.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"Tensor dtype {dtype!r} is not allowed on the wire.")
    torch_dtype = _DTYPES[dtype]
    view = memoryview(buffer)
    numel = math.prod(shape)
    expected = numel * torch_dtype.itemsize
    if view.nbytes != expected:
        raise ValueError(
            f"Tensor frame has {view.nbytes} bytes; {dtype}{list(shape)} needs {expected}."
        )
    if numel == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    with warnings.catch_warnings():
        # ZeroMQ frames are read-only buffers; the engine only reads pixel values.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch_dtype).view(tuple(shape))


# ---- conversions to and from the engine's own types --------------------------------------


def requests_to_wire(requests: Sequence[Request]) -> tuple[AddRequest, list[memoryview]]:
    """Engine ``Request``s → their message and the raw tensor frames that follow it.

    ``requests[1:]`` are siblings of ``requests[0]`` (``InputProcessor.make_requests``).

    Raises:
        ValueError: a sibling does not share the first request's prompt token ids and images
            (the same objects), EOS id and cache salt.
    """
    request, siblings = requests[0], requests[1:]
    for sibling in siblings:
        if (
            sibling.prompt_token_ids is not request.prompt_token_ids
            or sibling.mm_features is not request.mm_features
            or (sibling.eos_token_id, sibling.cache_salt, sibling.lora_request)
            != (request.eos_token_id, request.cache_salt, request.lora_request)
        ):
            raise ValueError(f"Request {sibling.request_id!r} is no sibling of the first.")
    buffers: list[memoryview] = []
    features = [feature_to_wire(feature, buffers) for feature in request.mm_features]
    message = AddRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        arrival_time=request.arrival_time,
        eos_token_id=request.eos_token_id,
        cache_salt=request.cache_salt,
        mm_features=features,
        siblings=[Sibling(s.request_id, s.sampling_params) for s in siblings],
        priority=request.priority,
        pooling_params=request.pooling_params,
        lora_request=request.lora_request,
    )
    return message, buffers


def feature_to_wire(feature: MultiModalFeature, buffers: list[memoryview]) -> MultiModalFeatureWire:
    """One image's message; its pixel tensor is appended to ``buffers``, the frames that follow
    the message body (frame ``len(buffers)`` after the append: frame 0 is the body)."""
    wire = MultiModalFeatureWire(
        feature.mm_hash, feature.placeholder.offset, feature.placeholder.length
    )
    data = feature.data
    if data is not None:
        pixels = data.pixel_values
        wire.num_tokens = data.num_tokens
        wire.image_grid_thw = tuple(data.image_grid_thw) if data.image_grid_thw else None
        wire.dtype = str(pixels.dtype).removeprefix("torch.")
        wire.shape = tuple(pixels.shape)
        wire.pixel_mean, wire.pixel_std = tuple(data.pixel_mean), tuple(data.pixel_std)
        wire.token_ids = data.token_ids
        wire.image_size = data.image_size
        wire.modality, wire.second_per_grid_t = data.modality, data.second_per_grid_t
        wire.frame = len(buffers) + 1
        buffers.append(tensor_to_buffer(pixels))
    return wire


def requests_from_wire(message: AddRequest, frames: Sequence[Buffer]) -> list[Request]:
    """The engine ``Request``s of an ``AddRequest`` (the first, then its siblings, sharing
    the prompt and the image tensors) whose tensor frames are ``frames``.

    Raises:
        RequestDecodeError: on a missing or malformed tensor frame or an invalid request.
    """
    try:
        features = [feature_from_wire(f, frames) for f in message.mm_features]
        children = [(message.request_id, message.sampling_params)]
        children += [(s.request_id, s.sampling_params) for s in message.siblings]
        shared = {"mm_features": features, "cache_salt": message.cache_salt}
        shared["arrival_time"] = message.arrival_time
        shared["priority"] = message.priority
        shared["pooling_params"] = message.pooling_params
        shared["lora_request"] = message.lora_request
        prompt, eos = message.prompt_token_ids, message.eos_token_id
        return [
            Request(request_id, prompt, params, eos, **shared) for request_id, params in children
        ]
    except (ValueError, IndexError) as e:
        raise RequestDecodeError(message.request_ids, str(e)) from e


def feature_from_wire(wire: MultiModalFeatureWire, frames: Sequence[Buffer]) -> MultiModalFeature:
    """The image of ``wire``, its pixels a view of ``frames[wire.frame]`` (ValueError when that
    frame is missing or malformed)."""
    data = None
    if wire.frame >= 0:
        if not 1 <= wire.frame < len(frames):
            raise ValueError(f"Image {wire.mm_hash!r} refers to missing frame {wire.frame}.")
        pixels = tensor_from_buffer(frames[wire.frame], wire.dtype, wire.shape)
        data = ProcessedImage(
            pixels,
            wire.num_tokens,
            wire.image_grid_thw,
            wire.pixel_mean,
            wire.pixel_std,
            wire.token_ids,
            wire.image_size,
            wire.modality,
            wire.second_per_grid_t,
        )
    return MultiModalFeature(wire.mm_hash, PlaceholderRange(wire.offset, wire.length), data)


# ---- codecs ------------------------------------------------------------------------------


class InputCodec:
    """Front end side encodes, engine side decodes the input messages (one per thread)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(InputMessage)

    def encode(self, message: AbortRequests | UtilityRequest) -> list[bytes]:
        return [self._encoder.encode(message)]

    def encode_request(self, request: Request, *siblings: Request) -> list[Buffer]:
        """Frames of an add-request (of ``request`` and its ``siblings``, see
        ``requests_to_wire``): the msgpack body, then one raw frame per image tensor."""
        message, buffers = requests_to_wire([request, *siblings])
        return [self._encoder.encode(message), *buffers]

    def decode(self, frames: Sequence[Buffer]) -> list[Request] | AbortRequests | UtilityRequest:
        """An add-request's engine requests (see ``requests_from_wire``), or the message.

        Raises ``RequestDecodeError`` on a malformed message (with its request ids if any).
        """
        try:
            message = self._decoder.decode(frames[0])
        except msgspec.DecodeError as e:
            raise RequestDecodeError(_request_ids_of(frames[0]), f"Malformed request: {e}") from e
        if isinstance(message, AddRequest):
            return requests_from_wire(message, frames)
        return message


def _request_ids_of(body: Buffer) -> list[str]:
    """The request ids of an add-request that failed typed decoding, as far as readable."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return []
    if not isinstance(raw, dict):
        return []
    siblings = raw.get("siblings") if isinstance(raw.get("siblings"), list) else []
    ids = [raw.get("request_id"), *(s[0] for s in siblings if isinstance(s, list) and s)]
    return [i for i in ids if isinstance(i, str)]


class OutputCodec:
    """Engine side encodes, front end side decodes the output messages (one per thread)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(OutputMessage)

    def encode(self, message: EngineCoreOutputs | EngineReady | EngineFailed) -> bytes:
        return self._encoder.encode(message)

    def decode(self, body: Buffer) -> EngineCoreOutputs | EngineReady | EngineFailed:
        """Raises ``msgspec.DecodeError`` on a malformed message (a bug, not user input)."""
        return self._decoder.decode(body)
