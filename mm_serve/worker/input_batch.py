"""The persistent input batch: preallocated per-row buffers, updated from the scheduler's diff.

Rows are requests. A request keeps its row while it runs; a finished or preempted request's
row is freed and the last rows are moved into the holes (``condense``), so rows
``0..num_reqs-1`` are always the live batch. Nothing is rebuilt from scratch per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.varlen_attention import plan_prefill_split, worth_splitting
from mm_serve.lora.request import LoRARequest
from mm_serve.messages.pooling_params import PoolingParams
from mm_serve.messages.request import MultiModalFeature
from mm_serve.messages.sampling_params import SamplingParams
from mm_serve.utils.transfer import StepUpload
from mm_serve.worker.sampling_metadata import SamplingMetadata


@dataclass(slots=True)
class CachedRequestState:
    """The runner's copy of one request; outlives its batch row across preemption."""

    req_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None
    block_ids: list[int]
    # As of its last entry into the batch; while in it, ``InputBatch.num_computed_tokens``.
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    # MEAN pooling: [hidden] float32 sum of the prompt's hidden states computed so far.
    hidden_states_sum: torch.Tensor | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens sampled by launched steps whose ids have not reached the host yet.
    num_pending_outputs: int = 0
    # Prompt positions whose logprobs were already returned (not re-sent after preemption).
    num_prompt_logprobs_done: int = 0
    # M-RoPE (Qwen2-VL): [3, num_prompt_tokens] prompt positions, and the decode offset.
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    lora_request: LoRARequest | None = None  # None: the base model

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_outputs

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, pending ones included (their ids arrive later)."""
        return len(self.prompt_token_ids) + self.num_output_tokens


class InputBatch:
    """Row-major buffers for up to ``max_num_reqs`` requests.

    Shapes: ``token_ids`` ``[max_num_reqs, max_model_len]`` int32, ``block_tables``
    ``[num_kv_cache_groups, max_num_reqs, max_blocks_per_req]`` int32 (``block_table`` is
    group 0's), per-row scalars ``[max_num_reqs]``. With several KV-cache groups, a request's
    block ids arrive interleaved by group (``cache.kv_cache_manager``).
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_groups = num_kv_cache_groups
        max_blocks = -(-max_model_len // block_size)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.mrope_delta = np.zeros(max_num_reqs, dtype=np.int64)  # CachedRequestState's
        shape = (num_kv_cache_groups, max_num_reqs, max_blocks)
        self.block_tables = np.zeros(shape, dtype=np.int32)
        self.block_table = self.block_tables[0]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        # Rows whose sampling needs their request's own settings (``_add_request_extras``).
        self.request_extras = np.zeros(max_num_reqs, dtype=bool)
        self.states: list[CachedRequestState | None] = [None] * max_num_reqs
        self.num_reqs = 0

    def upload_capacity(self, max_num_tokens: int) -> int:
        """Bytes one step of at most ``max_num_tokens`` tokens stages (``ModelRunner.
        _prepare_inputs``), so that its ``StepUpload`` never grows while serving: per token its
        id, (M-RoPE) positions, slots, key limit and image-row index; per request its block
        tables, query start, length, logits index, in-flight token indices and sampling
        settings; 16 bytes of alignment per array. Only penalties' padded prompts may go past
        it (they then travel on their own)."""
        max_blocks = self.block_tables.shape[2]
        per_token = 8 + 24 + 8 * self.num_groups + 4 + 8
        per_request = 4 * max_blocks * self.num_groups + 4 + 4 + 8 + 16 + 44
        return max_num_tokens * per_token + self.max_num_reqs * per_request + 1024

    # ---- rows in and out -----------------------------------------------------------------

    def add_request(self, state: CachedRequestState) -> None:
        """Put a request into the first free row (``num_reqs``; the batch is condensed)."""
        row = self.num_reqs
        self.num_reqs += 1
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self.states[row] = state
        prompt, output = state.prompt_token_ids, state.output_token_ids
        self.token_ids[row, : len(prompt)] = prompt
        self.token_ids[row, len(prompt) : len(prompt) + len(output)] = output
        self.num_tokens[row] = state.num_tokens
        self.num_prompt_tokens[row] = len(prompt)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.mrope_delta[row] = state.mrope_delta
        self.num_blocks[row] = 0
        self.append_block_ids(row, state.block_ids)
        params = state.sampling_params
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.request_extras[row] = (
            state.generator is not None
            or params.logprobs is not None
            or params.needs_penalties
            or bool(params.logit_bias)
            or params.min_tokens > 0
        )

    def remove_requests(self, req_ids: set[str]) -> None:
        """Free the rows of these requests (absent ids are ignored), then condense."""
        empty = sorted(self.req_id_to_index.pop(r) for r in req_ids if r in self.req_id_to_index)
        for row in empty:
            self.req_ids[row] = None
            self.states[row] = None
        self._condense(empty)

    def _condense(self, empty_rows: list[int]) -> None:
        """Move the last live rows into the holes so rows 0..num_reqs-1 stay dense."""
        num_live = self.num_reqs - len(empty_rows)
        holes = [row for row in empty_rows if row < num_live]
        movers = [r for r in range(num_live, self.num_reqs) if self.req_ids[r] is not None]
        for hole, src in zip(holes, movers, strict=True):
            self._move_row(src, hole)
        self.num_reqs = num_live

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.states[dst], self.states[src] = self.states[src], None
        self.req_id_to_index[req_id] = dst
        num_tokens, num_blocks = self.num_tokens[src], self.num_blocks[src]
        self.token_ids[dst, :num_tokens] = self.token_ids[src, :num_tokens]
        self.block_tables[:, dst, :num_blocks] = self.block_tables[:, src, :num_blocks]
        for array in vars(self).values():  # every per-row column (``[max_num_reqs]``)
            if isinstance(array, np.ndarray) and array.ndim == 1:
                array[dst] = array[src]

    # ---- per-step updates ----------------------------------------------------------------

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        """Append a request's new block ids (interleaved by group) to its block tables."""
        start, count = self.num_blocks[row], len(block_ids) // self.num_groups
        if self.num_groups == 1:
            self.block_table[row, start : start + count] = block_ids
        else:
            by_group = np.asarray(block_ids, dtype=np.int32).reshape(count, self.num_groups)
            self.block_tables[:, row, start : start + count] = by_group.T
        self.num_blocks[row] = start + count

    def slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``[num_groups, T]`` int64 cache slot of each token (``rows``, ``positions``: the
        token's batch row and absolute position, ``[T]``) in each group's blocks."""
        blocks = self.block_tables[:, rows, positions // self.block_size]
        return blocks.astype(np.int64) * self.block_size + positions % self.block_size

    def attention_metadata(
        self,
        slot_mapping: np.ndarray,  # [num_groups, num_tokens] int64 (``slot_mapping()``)
        query_start_loc: np.ndarray,  # [num_reqs + 1]
        seq_lens: np.ndarray,  # [num_reqs]
        upload: StepUpload,
        key_end: np.ndarray | None = None,  # [num_tokens]: AttentionMetadata.key_end
    ) -> AttentionMetadata:
        """The step's ``AttentionMetadata`` over rows ``0..num_reqs``, its tensors staged in
        ``upload`` (valid once it is flushed), with its host copies, each KV-cache group's
        after the first in ``group_metadata``, and on CUDA the FlashAttention-2 split of a
        step of long fresh prompts (``varlen_attention``; one group and no ``key_end``
        only)."""
        num_reqs = len(seq_lens)
        width = int(self.num_blocks[:num_reqs].max())
        block_table = self.block_table[:num_reqs, :width]
        device, stage = upload.device, upload.stage
        split = device.type == "cuda" and key_end is None and self.num_groups == 1
        split = split and worth_splitting(query_start_loc, seq_lens)
        metadata = AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=slot_mapping.shape[1],
            slot_mapping=stage(slot_mapping[0], torch.int64),
            query_start_loc=stage(query_start_loc, torch.int32),
            seq_lens=stage(seq_lens, torch.int32),
            block_table=stage(block_table, torch.int32),
            max_query_len=int(np.diff(query_start_loc).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            prefill_split=plan_prefill_split(
                query_start_loc, seq_lens, block_table, slot_mapping[0], device
            )
            if split
            else None,
            key_end=None if key_end is None else stage(key_end, torch.int32),
        )
        if self.num_groups == 1:
            return metadata
        metadata.group_metadata = tuple(
            dataclasses.replace(
                metadata,
                slot_mapping=stage(slot_mapping[g], torch.int64),
                block_table=stage(self.block_tables[g, :num_reqs, :width], torch.int32),
            )
            for g in range(1, self.num_groups)
        )
        return metadata

    def sampling_metadata(self, rows: np.ndarray, upload: StepUpload) -> SamplingMetadata:
        """Gather the sampling settings of ``rows`` (those that produce a token this step),
        its tensors staged in ``upload``. The per-request settings (generators, logprobs,
        penalties, logit bias, banned tokens) are looked up only when a row has one."""
        temperature = self.temperature[rows]

        def tensor(array: np.ndarray, off_value: float) -> torch.Tensor | None:
            values = array[rows]
            return None if np.all(values == off_value) else upload.stage(values)

        metadata = SamplingMetadata(
            temperature=upload.stage(temperature),
            all_greedy=bool(np.all(temperature == 0.0)),
            all_random=bool(np.all(temperature != 0.0)),
            top_p=tensor(self.top_p, 1.0),
            top_k=tensor(self.top_k, 0),
            min_p=tensor(self.min_p, 0.0),
        )
        if self.request_extras[rows].any():
            self._add_request_extras(metadata, rows, upload)
        return metadata

    def any_penalties(self, rows: np.ndarray | slice) -> bool:
        """Whether a request of ``rows`` has a presence, frequency or repetition penalty."""
        return bool(
            np.any(self.presence_penalty[rows] != 0.0)
            or np.any(self.frequency_penalty[rows] != 0.0)
            or np.any(self.repetition_penalty[rows] != 1.0)
        )

    def _add_request_extras(
        self, metadata: SamplingMetadata, rows: np.ndarray, upload: StepUpload
    ) -> None:
        """Fill in ``metadata``'s per-request settings (``request_extras`` rows have some)."""
        states = [self.states[row] for row in rows]
        params = [s.sampling_params for s in states]
        metadata.generators = {
            i: s.generator for i, s in enumerate(states) if s.generator is not None
        }
        metadata.max_num_logprobs = max(
            (p.logprobs for p in params if p.logprobs is not None), default=None
        )
        metadata.banned_token_ids = {
            i: banned for i, s in enumerate(states) if (banned := _banned_tokens(s))
        }
        metadata.logit_bias = {i: p.logit_bias for i, p in enumerate(params) if p.logit_bias}
        if self.any_penalties(rows):
            metadata.no_penalties = False
            metadata.presence_penalties = upload.stage(self.presence_penalty[rows])
            metadata.frequency_penalties = upload.stage(self.frequency_penalty[rows])
            metadata.repetition_penalties = upload.stage(self.repetition_penalty[rows])
            metadata.prompt_token_ids = self._padded_prompts(rows, upload)
            metadata.output_token_ids = [s.output_token_ids for s in states]

    def _padded_prompts(self, rows: np.ndarray, upload: StepUpload) -> torch.Tensor:
        """``[len(rows), max_prompt_len]`` prompt ids from the batch's buffer, padded with
        ``vocab_size`` (an id no logit has)."""
        lengths = self.num_prompt_tokens[rows]
        prompts = self.token_ids[rows, : lengths.max()].astype(np.int64)
        prompts[np.arange(prompts.shape[1]) >= lengths[:, None]] = self.vocab_size
        return upload.stage(prompts)


def _banned_tokens(state: CachedRequestState) -> list[int]:
    """Stop tokens (EOS included) are forbidden until ``min_tokens`` outputs exist."""
    params = state.sampling_params
    if state.num_output_tokens >= params.min_tokens:
        return []
    eos = [] if params.ignore_eos or state.eos_token_id is None else [state.eos_token_id]
    return list(params.stop_token_ids) + eos
