"""The messages between the engine core (executor) and its tensor-parallel workers.

Core → every worker (one ZeroMQ multipart message each, the same bytes to every rank): frame 0
is the msgpack body of an ``ExecuteModel`` (one step's ``SchedulerOutput``) or a ``WorkerCall``
(start-up and reset calls); image pixels and a grammar bitmask follow as raw frames. Worker →
core: one msgpack frame of ``WorkerResult`` (every rank answers a call), ``StepResult`` (rank 0
only, one per step, in order) or ``WorkerFailed``. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec

from mm_serve.lora.request import LoRARequest
from mm_serve.messages.pooling_params import PoolingParams
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.messages.wire import (
    Buffer,
    MultiModalFeatureWire,
    feature_from_wire,
    feature_to_wire,
    tensor_from_buffer,
    tensor_to_buffer,
)
from mm_serve.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from mm_serve.sched.structured_output import GrammarBitmask


class NewRequestWire(msgspec.Struct, array_like=True):
    """``NewRequestData`` with its images as ``MultiModalFeatureWire`` (pixels in frames)."""

    req_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeatureWire]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None


class GrammarBitmaskWire(msgspec.Struct, array_like=True):
    """``GrammarBitmask`` whose int32 ``[len(req_ids), words]`` bitmask is frame ``frame``."""

    req_ids: list[str]
    num_tokens: int
    shape: tuple[int, ...]
    frame: int


class ExecuteModel(msgspec.Struct, tag="execute"):
    """One step: the fields of ``SchedulerOutput``, and the grammar bitmask the core computed
    for its grammar requests (None: no grammar this step)."""

    scheduled_new_reqs: list[NewRequestWire]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]
    scheduled_encoder_inputs: dict[str, list[int]]
    free_encoder_mm_hashes: list[str]
    structured_output_request_ids: list[str]
    grammar_bitmask: GrammarBitmaskWire | None = None


class WorkerCall(msgspec.Struct, tag="call"):
    """A ``ModelRunner`` method every rank runs and answers with a ``WorkerResult``:
    "determine_num_kv_blocks", "initialize_kv_cache" (``arg``: blocks), "capture_cuda_graphs",
    "reset_encoder_cache"; "flush" sends the last step's output, "shutdown" ends the worker
    (neither has an answer of its own)."""

    method: str
    arg: int = 0


class WorkerResult(msgspec.Struct, tag="result"):
    rank: int
    value: int | None = None


class StepResult(msgspec.Struct, tag="step"):
    """Rank 0's output of one ``ExecuteModel``."""

    output: ModelRunnerOutput


class WorkerFailed(msgspec.Struct, tag="failed"):
    """A worker's fatal error, with its traceback; the worker exits after sending it."""

    rank: int
    error: str


ToWorker = ExecuteModel | WorkerCall
FromWorker = WorkerResult | StepResult | WorkerFailed


def encode_step(scheduler_output: SchedulerOutput, bitmask: GrammarBitmask | None) -> list[Buffer]:
    """The frames of one step's ``ExecuteModel``: the body, then the pixel and bitmask frames."""
    buffers: list[memoryview] = []
    new_reqs = []
    for new in scheduler_output.scheduled_new_reqs:
        features = [feature_to_wire(feature, buffers) for feature in new.mm_features]
        fields = {**vars(new), "mm_features": features}
        new_reqs.append(NewRequestWire(**fields))
    grammar = None
    if bitmask is not None:
        buffers.append(tensor_to_buffer(bitmask.bitmask))
        shape = tuple(bitmask.bitmask.shape)
        grammar = GrammarBitmaskWire(bitmask.req_ids, bitmask.num_tokens, shape, len(buffers))
    fields = {
        f.name: getattr(scheduler_output, f.name) for f in dataclasses.fields(SchedulerOutput)
    }
    fields |= {
        "scheduled_new_reqs": new_reqs,
        "finished_req_ids": sorted(fields["finished_req_ids"]),
    }
    message = ExecuteModel(**fields, grammar_bitmask=grammar)
    return [msgspec.msgpack.encode(message), *buffers]


def decode_step(
    message: ExecuteModel, frames: Sequence[Buffer]
) -> tuple[SchedulerOutput, GrammarBitmask | None]:
    """The ``SchedulerOutput`` and grammar bitmask of an ``ExecuteModel`` whose frames (body
    first) are ``frames``. Raises ``ValueError`` on a missing or malformed frame."""
    new_reqs = []
    for wire in message.scheduled_new_reqs:
        features = [feature_from_wire(f, frames) for f in wire.mm_features]
        fields = msgspec.structs.asdict(wire)
        new_reqs.append(NewRequestData(**{**fields, "mm_features": features}))
    bitmask = None
    grammar = message.grammar_bitmask
    if grammar is not None:
        tensor = tensor_from_buffer(frames[grammar.frame], "int32", grammar.shape)
        bitmask = GrammarBitmask(grammar.req_ids, tensor, grammar.num_tokens)
    fields = msgspec.structs.asdict(message)
    del fields["grammar_bitmask"]
    fields |= {"scheduled_new_reqs": new_reqs, "finished_req_ids": set(fields["finished_req_ids"])}
    scheduler_output = SchedulerOutput(**fields)
    return scheduler_output, bitmask


_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


def decode_to_worker(body: Buffer) -> ToWorker:
    """Raises ``msgspec.DecodeError`` on a malformed message (a bug, not user input)."""
    return _to_worker.decode(body)


def decode_from_worker(body: Buffer) -> FromWorker:
    """Raises ``msgspec.DecodeError`` on a malformed message (a bug, not user input)."""
    return _from_worker.decode(body)
