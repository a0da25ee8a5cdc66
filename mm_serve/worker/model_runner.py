"""The model runner: applies the scheduler's diff to the persistent batch, runs the model, samples.

Its only input is the ``SchedulerOutput`` of each step, so any number of workers holding the same
state can replay the same steps (tensor parallelism).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mm_serve.cache.kv_cache_groups import kv_cache_layout
from mm_serve.config import EngineConfig
from mm_serve.distributed.parallel_state import init_tensor_parallel
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.config import configure_kernels
from mm_serve.lora.manager import LoRAManager
from mm_serve.models.interface import LanguageModel
from mm_serve.models.loader import load_model
from mm_serve.sched.output import CachedRequestData, SchedulerOutput
from mm_serve.sched.structured_output import GrammarBitmask
from mm_serve.utils.transfer import StepUpload
from mm_serve.worker.compile import LMForward, lm_forward
from mm_serve.worker.cuda_graphs import (
    CudaGraphRunner,
    MixedCudaGraphRunner,
    capture_graphs,
    capture_tower_graphs,
    is_decode_only,
)
from mm_serve.worker.encoder_dp import shard_tower_over_ranks
from mm_serve.worker.input_batch import CachedRequestState, InputBatch
from mm_serve.worker.kv_cache import allocate_kv_caches, bind_kv_caches, determine_num_kv_blocks
from mm_serve.worker.mm_inputs import (
    encode_images,
    gather_image_embeddings,
    image_key_end,
    mrope_positions,
    scheduled_slices,
)
from mm_serve.worker.pooler import PoolingStep, pool
from mm_serve.worker.prompt_logprobs import (
    PromptLogprobsJob,
    compute_prompt_logprobs,
    prompt_logprobs_jobs,
)
from mm_serve.worker.sampler import Sampler
from mm_serve.worker.sampling_metadata import GrammarMask, SamplingMetadata
from mm_serve.worker.step_output import PendingOutput, SampledTokens

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """The flattened batch of one step (``num_tokens`` = sum of the scheduled tokens)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, or [3, num_tokens] with M-RoPE
    # Image embeddings replacing placeholder tokens: (batch rows [n], embeddings [n, hidden]).
    image_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    attn_metadata: AttentionMetadata
    sample_rows: np.ndarray  # batch rows that produce a token this step
    logits_indices: torch.Tensor  # [len(sample_rows)] int64, last scheduled token of each
    sampling_metadata: SamplingMetadata | None  # of sample_rows (None when there are none)
    prompt_logprobs_jobs: list[PromptLogprobsJob]


class ModelRunner:
    """Owns the model, the KV cache tensors and the persistent input batch of one device;
    ``rank``: its tensor-parallel rank (of ``config.parallel.tensor_parallel_size``)."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = config.device
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        # Every request is an embedding request: pooled, never sampled (``worker.pooler``).
        self.pooling = config.model.runner == "pooling"
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_cache_layout = kv_cache_layout(config.model.hf_config)
        self.input_batch = InputBatch(
            max_num_reqs=config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            vocab_size=config.model.vocab_size,
            num_kv_cache_groups=self.kv_cache_layout.num_groups,
        )
        self.sampler = Sampler()
        # Each step's host arrays, in one copy; sized for the largest step.
        capacity = self.input_batch.upload_capacity(config.scheduler.max_num_batched_tokens)
        self.upload = StepUpload(self.device, capacity)
        self.model: LanguageModel | None = None
        self.lora_manager: LoRAManager | None = None  # set by load_model with enable_lora
        self.lm_forward: LMForward | None = None  # set by load_model (worker.compile)
        self.kv_caches: list[torch.Tensor] = []
        # mm_hash -> [num_tokens, hidden] image embeddings; what enters and leaves is decided
        # by the scheduler's EncoderCacheManager.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        # Set by capture_cuda_graphs(): decode-only steps, and the other steps by token count.
        self.cuda_graphs: CudaGraphRunner | None = None
        self.mixed_graphs: MixedCudaGraphRunner | None = None
        # The last launched step's sampled tokens (on the device) and its output in flight.
        self.last_sampled: SampledTokens | None = None
        self.last_output: PendingOutput | None = None
        # The step whose forward pass is launched and whose tokens are not yet sampled.
        self._launched: tuple[StepInputs, torch.Tensor] | None = None

    def load_model(self) -> None:
        # This process's worker state, before the model is built: its tensor-parallel rank
        # (one device: rank 0 of 1) and the kernels' mode and PDL.
        init_tensor_parallel(self.rank, self.config.parallel.tensor_parallel_size)
        configure_kernels(self.config.kernels)
        model_config = self.config.model
        logger.info(
            "Loading weights of %s (%s) on %s", model_config.model, model_config.dtype, self.device
        )
        start = time.perf_counter()
        torch.manual_seed(model_config.seed)
        self.model = load_model(model_config, self.device)
        if self.config.lora is not None:
            max_tokens = self.config.scheduler.max_num_batched_tokens
            self.lora_manager = LoRAManager(self.model, self.config.lora, max_tokens)
        self.lm_forward = lm_forward(self.model, self.config)
        logger.info("Loaded the weights in %.1f s", time.perf_counter() - start)

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit (``worker.kv_cache``), counting the memory of the vision
        tower's graphs, captured first (``capture_tower_graphs``); then, under TP with
        ``mm_encoder_tp_mode`` "data", the tower is split over the ranks (``encoder_dp``)."""
        capture_tower_graphs(self.model, self.config)
        shard_tower_over_ranks(self.model, self.config.multimodal.mm_encoder_tp_mode)
        return determine_num_kv_blocks(self.config, self.model)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.config, num_blocks)
        bind_kv_caches(self.model, self.kv_caches, self.kv_cache_layout)

    def capture_cuda_graphs(self) -> None:
        """Capture the LM's graphs (after the KV cache is bound; see
        ``worker.cuda_graphs.capture_graphs``)."""
        self.cuda_graphs, self.mixed_graphs = capture_graphs(
            self.model, self.lm_forward, self.config
        )

    def shutdown(self) -> None:
        """Nothing to stop: the runner lives in the engine core's process (the executor of
        several ranks stops its workers here)."""

    def reset_encoder_cache(self) -> None:
        """Drop every image embedding (``EngineCore.reset``)."""
        self.encoder_cache.clear()

    # ---- one step ------------------------------------------------------------------------

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: Callable[[], GrammarBitmask] | None = None,
    ) -> PendingOutput:
        """Launch one step: ``launch_forward``, then ``sample_tokens`` within the bitmask that
        ``grammar_bitmask()`` gives once the forward pass is queued (none: no grammar)."""
        self.launch_forward(scheduler_output)
        return self.sample_tokens(None if grammar_bitmask is None else grammar_bitmask())

    @torch.inference_mode()
    def launch_forward(self, scheduler_output: SchedulerOutput) -> None:
        """Launch the step's forward pass (the device work is queued); ``sample_tokens`` then
        samples from it. Tokens the previous step sampled may still be on their way to the
        host; this step's inputs take them from the device."""
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        self._update_states(scheduler_output)
        self._launched = None
        if scheduler_output.total_num_scheduled_tokens == 0:
            return
        if self.last_output is not None and self._needs_output_ids():
            self.last_output.get()  # penalties count the output ids: wait for the last ones
        if self.lora_manager is not None:
            self.lora_manager.activate(state.lora_request for state in self._batch_states())
        encode_images(
            self.model,
            self.requests,
            scheduler_output.scheduled_encoder_inputs,
            self.encoder_cache,
            self.lora_manager,
        )
        inputs = self._prepare_inputs(scheduler_output)
        self._launched = (inputs, self._forward(inputs))

    @torch.inference_mode()
    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None = None) -> PendingOutput:
        """Sample the tokens of the step ``launch_forward`` launched, the grammar requests'
        within ``grammar_bitmask``. The output comes back as a ``PendingOutput``: the device
        work is queued, and ``get()`` waits for it."""
        if self._launched is None:
            return PendingOutput([])
        (inputs, hidden_states), self._launched = self._launched, None
        if self.pooling:  # its sample rows, whose prompts end, are pooled instead
            return self._pooling_output(hidden_states, inputs)
        sampler_output = None
        if len(inputs.sample_rows):  # none while every request is mid-prompt
            logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
            metadata = inputs.sampling_metadata
            if grammar_bitmask is not None:
                req_ids = [self.input_batch.req_ids[row] for row in inputs.sample_rows]
                metadata.grammar = GrammarMask.for_rows(grammar_bitmask, req_ids, self.device)
            sampler_output = self.sampler(logits, metadata)
        prompt_logprobs = compute_prompt_logprobs(
            self.model, hidden_states, inputs.prompt_logprobs_jobs
        )
        return self._launch_output(inputs.sample_rows, sampler_output, prompt_logprobs)

    def _pooling_output(self, hidden_states: torch.Tensor, inputs: StepInputs) -> PendingOutput:
        """The embeddings of the requests whose prompts end this step (``worker.pooler``), on
        their way to the host; the pooling runner samples nothing."""
        states = self._batch_states()
        step = PoolingStep(states, inputs.attn_metadata.query_start_loc_cpu, inputs.sample_rows)
        self.last_sampled = None
        req_ids = [state.req_id for state in states]
        return PendingOutput(req_ids, pooled=pool(hidden_states, step))

    def _batch_states(self) -> list[CachedRequestState]:
        return self.input_batch.states[: self.input_batch.num_reqs]

    def _needs_output_ids(self) -> bool:
        return self.input_batch.any_penalties(slice(0, self.input_batch.num_reqs))

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The LM over the flattened batch; image embeddings replace their placeholders.
        A step replays a CUDA graph when one was captured for its kind and size."""
        metadata = inputs.attn_metadata
        if self._use_cuda_graph(inputs):
            return self.cuda_graphs.run(inputs.input_ids, inputs.positions, metadata)
        graphs = self.mixed_graphs
        mixed = graphs is not None and metadata.prefill_split is None and metadata.key_end is None
        mixed = mixed and graphs.padded_size(metadata.num_tokens) is not None
        inputs_embeds = self.model.get_input_embeddings(inputs.input_ids)
        if inputs.image_embeddings is not None:
            rows, embeddings = inputs.image_embeddings
            inputs_embeds[rows] = embeddings.to(inputs_embeds.dtype)
        if mixed:
            return graphs.run(inputs_embeds, inputs.positions, metadata)
        return self.lm_forward(inputs.positions, inputs_embeds, metadata)

    def _use_cuda_graph(self, inputs: StepInputs) -> bool:
        """Whether the step is decode-only and a decode graph holds its batch."""
        if self.cuda_graphs is None or not self.cuda_graphs.can_run(inputs.attn_metadata.num_reqs):
            return False
        query_lens = np.diff(inputs.attn_metadata.query_start_loc_cpu)
        return is_decode_only(
            query_lens, inputs.image_embeddings is not None, bool(inputs.prompt_logprobs_jobs)
        )

    def _new_request_state(self, new) -> CachedRequestState:
        params = new.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        # NewRequestData's fields, the block list copied (the state's grows).
        state = CachedRequestState(
            **{**vars(new), "block_ids": list(new.block_ids)}, generator=generator
        )
        if self.model.uses_mrope:
            from mm_serve.models.mrope import get_mrope_input_positions

            items = [f.data for f in new.mm_features]  # images and videos, in prompt order
            table, state.mrope_delta = get_mrope_input_positions(
                new.prompt_token_ids, items, self.config.model.hf_config
            )
            state.mrope_positions = table.numpy()
        return state

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff: drop finished, park unscheduled, add new, extend the rest."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        # Requests in the batch that were not scheduled (finished, preempted, or waiting for the
        # encoder) leave it; the others keep their state here and are added back when scheduled.
        scheduled = scheduler_output.num_scheduled_tokens
        batch.remove_requests({r for r in batch.req_id_to_index if r not in scheduled})

        for new in scheduler_output.scheduled_new_reqs:
            state = self._new_request_state(new)
            self.requests[new.req_id] = state
            batch.add_request(state)

        self._update_cached_states(scheduler_output.scheduled_cached_reqs)

    def _update_cached_states(self, cached: CachedRequestData) -> None:
        """Apply the diffs of requests the runner holds: their computed tokens in one vector
        write; new blocks, resumption and re-adding to the batch one by one (few per step).
        A state's ``num_computed_tokens`` is brought up to date when it enters the batch."""
        batch = self.input_batch
        row_of = batch.req_id_to_index
        rows = [row_of.get(req_id, -1) for req_id in cached.req_ids]
        num_computed = cached.num_computed_tokens
        in_batch = np.array(rows, dtype=np.int64)
        kept = in_batch >= 0
        batch.num_computed_tokens[in_batch[kept]] = np.array(num_computed, dtype=np.int32)[kept]
        for i, (row, resumed, new_block_ids) in enumerate(
            zip(rows, cached.resumed_from_preemption, cached.new_block_ids, strict=True)
        ):
            if row >= 0 and not resumed and not new_block_ids:
                continue  # a decode step within its blocks: done above
            state = self.requests[cached.req_ids[i]]
            state.num_computed_tokens = num_computed[i]
            if resumed:
                state.block_ids = list(new_block_ids)
                state.hidden_states_sum = None  # its prompt is computed again from the start
            else:
                state.block_ids.extend(new_block_ids)
            if row < 0:  # preempted, or skipped a step (waiting for the encoder)
                batch.add_request(state)
            elif new_block_ids:  # most decode steps fill the last block they have
                batch.append_block_ids(row, new_block_ids)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """Flatten the batch: token ids, positions, slot mapping, block table (vectorised)."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids[:num_reqs]
        num_scheduled = np.fromiter(
            map(scheduler_output.num_scheduled_tokens.__getitem__, req_ids), np.int64, num_reqs
        )
        cu_num_tokens = np.cumsum(num_scheduled)
        total = int(cu_num_tokens[-1])
        # For each token: its row, and its offset inside its request's scheduled chunk.
        row_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
        offset_in_chunk = np.arange(total) - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        num_computed = batch.num_computed_tokens[:num_reqs].astype(np.int64)
        positions = num_computed[row_of_token] + offset_in_chunk
        input_ids = batch.token_ids[row_of_token, positions]
        slot_mapping = batch.slot_mapping(row_of_token, positions)  # [groups, T]
        seq_lens = num_computed + num_scheduled
        query_start_loc = np.concatenate([[0], cu_num_tokens])
        # A request samples once all its tokens are computed (prompt done); ``num_tokens``
        # counts the tokens sampled by steps still in flight.
        sample_rows = np.nonzero(seq_lens == batch.num_tokens[:num_reqs])[0]
        device, stage = self.device, self.upload.stage
        states = batch.states[:num_reqs]
        prompt_rows = np.nonzero(num_computed < batch.num_prompt_tokens[:num_reqs])[0]
        slices = scheduled_slices(states, prompt_rows, num_computed, query_start_loc)
        key_end = None  # image tokens that attend to each other (Gemma 3)
        if slices and self.model.bidirectional_images:
            image_token = self.model.image_token_id
            key_end = image_key_end(states, positions, query_start_loc, num_computed, image_token)
        attn_metadata = batch.attention_metadata(
            slot_mapping, query_start_loc, seq_lens, self.upload, key_end
        )
        if self.lora_manager is not None:
            slot_of = self.lora_manager.slot_of
            row_slots = np.array([slot_of(state.lora_request) for state in states], np.int64)
            self.lora_manager.set_token_slots(row_slots, row_of_token)
        if self.model.uses_mrope:
            delta = batch.mrope_delta[:num_reqs]
            positions = mrope_positions(states, delta, positions, query_start_loc, prompt_rows)
        cache = self.encoder_cache
        image_embeddings = gather_image_embeddings(cache, slices, self.upload) if slices else None
        in_flight = self._in_flight_tokens(num_computed, num_scheduled, query_start_loc)
        inputs = StepInputs(
            input_ids=stage(input_ids, torch.int64),
            positions=stage(positions, torch.int64),
            image_embeddings=image_embeddings,
            attn_metadata=attn_metadata,
            sample_rows=sample_rows,
            logits_indices=stage(cu_num_tokens[sample_rows] - 1, torch.int64),
            sampling_metadata=batch.sampling_metadata(sample_rows, self.upload)
            if len(sample_rows)
            else None,
            prompt_logprobs_jobs=prompt_logprobs_jobs(
                self.input_batch, prompt_rows, num_computed, query_start_loc, device
            ),
        )
        if in_flight is not None:
            dst, src = (stage(index, torch.int64) for index in in_flight)
        self.upload.flush()  # before any kernel reads what was staged
        if in_flight is not None:
            inputs.input_ids[dst] = self.last_sampled.token_ids[src]
        return inputs

    def _in_flight_tokens(
        self, num_computed: np.ndarray, num_scheduled: np.ndarray, query_start_loc: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The previous step's sampled tokens that this step's ``input_ids`` take from the
        device (``SampledTokens.destinations``); None when the host already wrote them into
        the batch (always so without async scheduling)."""
        if self.last_sampled is None or self.last_output.done:
            return None
        row_of = self.input_batch.req_id_to_index
        return self.last_sampled.destinations(row_of, num_computed, num_scheduled, query_start_loc)

    def _launch_output(self, sample_rows, sampler_output, prompt_logprobs) -> PendingOutput:
        """Count the sampled tokens in the batch now (their ids arrive with the output) and
        start their copy to the host."""
        batch = self.input_batch
        req_ids = list(batch.req_ids[: batch.num_reqs])
        if sampler_output is None:
            self.last_sampled = None
            return PendingOutput(req_ids, prompt_logprobs=prompt_logprobs)
        rows = sample_rows.tolist()
        if len(rows) == len(req_ids):  # every row samples (rows are 0..n-1): a decode step
            states, sampled_ids = batch.states[: len(rows)], req_ids
        else:
            states = [batch.states[row] for row in rows]
            sampled_ids = [req_ids[row] for row in rows]
        for state in states:
            state.num_pending_outputs += 1
        num_logprobs = None
        if sampler_output.logprobs is not None:
            num_logprobs = [state.sampling_params.logprobs for state in states]
        sampled = SampledTokens(
            token_ids=sampler_output.sampled_token_ids,
            rows=rows,
            req_ids=sampled_ids,
            positions=batch.num_tokens[sample_rows].astype(np.int64),
            num_logprobs=num_logprobs,
        )
        batch.num_tokens[sample_rows] += 1
        self.last_sampled = sampled
        self.last_output = PendingOutput(
            req_ids, sampled, sampler_output.logprobs, prompt_logprobs, self._record_tokens
        )
        return self.last_output

    def _record_tokens(self, sampled: SampledTokens, tokens: list[int]) -> None:
        """The sampled ids have reached the host: write them into the request states and the
        batch rows (wherever the requests are now; finished ones are gone)."""
        batch, requests = self.input_batch, self.requests
        row_of = batch.req_id_to_index
        for state, token in zip(map(requests.get, sampled.req_ids), tokens, strict=True):
            if state is not None:
                state.output_token_ids.append(token)
                state.num_pending_outputs -= 1
        rows = np.array([row_of.get(req_id, -1) for req_id in sampled.req_ids], dtype=np.int64)
        kept = rows >= 0
        batch.token_ids[rows[kept], sampled.positions[kept]] = np.asarray(tokens)[kept]
