"""The messages between the front end and the engine core process (ZeroMQ + msgspec).

Front end → engine (one ZeroMQ multipart message each): frame 0 is the msgpack body of an
``AddRequest``, ``AbortRequests`` or ``UtilityRequest``; an ``AddRequest``'s image tensors
follow as raw frames (frame ``MultiModalFeatureWire.frame``), sent and received without a
copy. Engine → front end: one msgpack frame of ``EngineReady``, ``EngineCoreOutputs`` or
``EngineFailed``. Nothing is pickled: the bodies are typed msgspec structs (``SamplingParams``
and ``EngineStats`` are plain dataclasses, which msgspec encodes and decodes by field).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from mm_serve.encoders.base import ProcessedImage
from mm_serve.outputs import EngineCoreOutput
from mm_serve.request import MultiModalFeature, PlaceholderRange, Request
from mm_serve.sampling_params import SamplingParams
from mm_serve.stats import EngineStats

# Tensor dtypes allowed on the wire, by name (never resolved with getattr on user input).
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}

# One top-k entry of a step: (token ids, log-probs, rank of the sampled token).
LogprobsEntry = tuple[list[int], list[float], int]
Buffer = Any  # anything with the buffer protocol: bytes, memoryview, zmq.Frame


class RequestDecodeError(ValueError):
    """A message from the front end that cannot become an engine request.

    ``request_id`` is the id it carried, or None when not even that could be read.
    """

    def __init__(self, request_id: str | None, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


# ---- front end → engine ------------------------------------------------------------------


class MultiModalFeatureWire(msgspec.Struct, omit_defaults=True):
    """One image of a request; its pixel tensor travels as raw frame ``frame`` (-1: none)."""

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


class AddRequest(msgspec.Struct, tag="add", omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.monotonic() of the front end (same host)
    eos_token_id: int | None = None
    cache_salt: str | None = None
    mm_features: list[MultiModalFeatureWire] = []


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityRequest(msgspec.Struct, tag="utility"):
    """A call answered by an ``EngineCoreOutputs`` with the same ``call_id``.

    ``method``: "get_stats" (fills ``stats`` and ``kv_cache`` of the answer).
    """

    call_id: int
    method: str


InputMessage = AddRequest | AbortRequests | UtilityRequest


# ---- engine → front end ------------------------------------------------------------------


class EngineCoreOutputWire(msgspec.Struct, array_like=True, omit_defaults=True):
    """``EngineCoreOutput`` on the wire (same fields, same meaning)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    new_prompt_logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_cached_images: int = 0


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
    """What one step produced, and/or the answer to a ``UtilityRequest`` (``call_id``)."""

    outputs: list[EngineCoreOutputWire] = []
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


def request_to_wire(request: Request) -> tuple[AddRequest, list[memoryview]]:
    """An engine ``Request`` → its message and the raw tensor frames that follow it."""
    buffers: list[memoryview] = []
    features = []
    for feature in request.mm_features:
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
            wire.frame = len(buffers) + 1
            buffers.append(tensor_to_buffer(pixels))
        features.append(wire)
    message = AddRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        arrival_time=request.arrival_time,
        eos_token_id=request.eos_token_id,
        cache_salt=request.cache_salt,
        mm_features=features,
    )
    return message, buffers


def request_from_wire(message: AddRequest, frames: Sequence[Buffer]) -> Request:
    """The engine ``Request`` of an ``AddRequest`` whose tensor frames are ``frames``.

    Raises:
        RequestDecodeError: on a missing or malformed tensor frame or an invalid request.
    """
    try:
        features = [_feature_from_wire(f, frames) for f in message.mm_features]
        return Request(
            message.request_id,
            message.prompt_token_ids,
            message.sampling_params,
            eos_token_id=message.eos_token_id,
            mm_features=features,
            cache_salt=message.cache_salt,
            arrival_time=message.arrival_time,
        )
    except (ValueError, IndexError) as e:
        raise RequestDecodeError(message.request_id, str(e)) from e


def _feature_from_wire(wire: MultiModalFeatureWire, frames: Sequence[Buffer]) -> MultiModalFeature:
    data = None
    if wire.frame >= 0:
        if not 1 <= wire.frame < len(frames):
            raise ValueError(f"Image {wire.mm_hash!r} refers to missing frame {wire.frame}.")
        pixels = tensor_from_buffer(frames[wire.frame], wire.dtype, wire.shape)
        data = ProcessedImage(
            pixels, wire.num_tokens, wire.image_grid_thw, wire.pixel_mean, wire.pixel_std
        )
    return MultiModalFeature(wire.mm_hash, PlaceholderRange(wire.offset, wire.length), data)


def output_to_wire(output: EngineCoreOutput) -> EngineCoreOutputWire:
    return EngineCoreOutputWire(
        output.request_id,
        output.new_token_ids,
        output.new_logprobs,
        output.new_prompt_logprobs,
        output.finish_reason,
        output.stop_reason,
        output.num_cached_tokens,
        output.num_cached_images,
    )


def output_from_wire(wire: EngineCoreOutputWire) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=wire.request_id,
        new_token_ids=wire.new_token_ids,
        new_logprobs=wire.new_logprobs,
        new_prompt_logprobs=wire.new_prompt_logprobs,
        finish_reason=wire.finish_reason,
        stop_reason=wire.stop_reason,
        num_cached_tokens=wire.num_cached_tokens,
        num_cached_images=wire.num_cached_images,
    )


# ---- codecs ------------------------------------------------------------------------------


class InputCodec:
    """Front end side encodes, engine side decodes the input messages (one per thread)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(InputMessage)

    def encode(self, message: AbortRequests | UtilityRequest) -> list[bytes]:
        return [self._encoder.encode(message)]

    def encode_request(self, request: Request) -> list[Buffer]:
        """Frames of an add-request: the msgpack body, then one raw frame per image tensor."""
        message, buffers = request_to_wire(request)
        return [self._encoder.encode(message), *buffers]

    def decode(self, frames: Sequence[Buffer]) -> Request | AbortRequests | UtilityRequest:
        """Raises ``RequestDecodeError`` on a malformed message (with its request id if any)."""
        try:
            message = self._decoder.decode(frames[0])
        except msgspec.DecodeError as e:
            raise RequestDecodeError(_request_id_of(frames[0]), f"Malformed request: {e}") from e
        if isinstance(message, AddRequest):
            return request_from_wire(message, frames)
        return message


def _request_id_of(body: Buffer) -> str | None:
    """The ``request_id`` of an add-request that failed typed decoding, if readable."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return None
    request_id = raw.get("request_id") if isinstance(raw, dict) else None
    return request_id if isinstance(request_id, str) else None


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
