"""CUDA graphs for the LM forward: decode-only steps by batch size, other steps by token count.

A decode step launches a few hundred small kernels whose CPU launch cost exceeds their GPU
time at small batches; replaying a captured graph launches them all at once. A step is
*decode-only* when every scheduled request has exactly one new token, no image embeddings fall
into the window and no prompt logprobs are wanted; its ``num_reqs`` rows are padded up to the
next captured size (:func:`padded_batch_size`). Every other step (prefill chunks, images,
prefill chunks mixed with decodes) of up to the largest captured token count replays a *mixed*
graph (:class:`MixedCudaGraphRunner`), its tokens padded up to the next captured count and its
requests up to the count's request capacity. Larger steps, the FlashAttention-2 split of long
fresh prompts, and CPU run eagerly.

Inside a graph every host-side value is frozen at capture: the kernels read the batch only
from the static device buffers below, which :meth:`CudaGraphRunner.run` fills in place. The
paged-attention launch takes ``max_seq_len = max_model_len`` at capture, so its split-KV
segment count is the worst case; each request splits its own keys over the segments on the
device (``tiles_per_segment = cdiv(num_tiles, NUM_SEGMENTS)``, empty segments get zero
weight in the merge), so the result is right for every length up to ``max_model_len``.

Padding rows are harmless: slot -1 (``reshape_and_cache`` skips negative slots), seq_len 1
and a valid block id (they read one cached token of some block and write nothing); their
outputs are never sampled. A mixed graph runs the paged kernel with its prefill launch config
(no split-KV) over ``num_reqs`` = the count's request capacity: padding requests have no
query rows (their programs return at once), and padding tokens belong to no request (their
attention rows are never written, and nothing reads them but row-wise layers).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import time

import numpy as np
import torch

from mm_serve.cache.kv_cache_groups import kv_cache_layout
from mm_serve.config import EngineConfig
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.worker.compile import LMForward
from mm_serve.worker.gemm_warmup import warm_gemm_kernels
from mm_serve.worker.tower_graphs import EncoderCudaGraphs, capture_graph

logger = logging.getLogger(__name__)


def padded_batch_size(num_reqs: int, sizes: tuple[int, ...] | list[int]) -> int | None:
    """The smallest captured size (``sizes`` ascending) that holds ``num_reqs`` rows, or None."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def is_decode_only(num_scheduled: np.ndarray, has_images: bool, has_prompt_logprobs: bool) -> bool:
    """True when every request schedules exactly one token and the step needs nothing but the
    LM's hidden states (no image embeddings to merge, no prompt logprobs)."""
    if has_images or has_prompt_logprobs or len(num_scheduled) == 0:
        return False
    return bool(np.all(num_scheduled == 1))


class _GraphFamily:
    """Graphs of one kind, one per size (ascending ``sizes``), captured largest first into a
    shared memory pool; ``_call(size)`` is the forward captured for ``size``, ``outputs[size]``
    its ``[size, hidden]`` hidden states.

    The static buffers every kind shares are allocated here for ``T = max(sizes)`` tokens and
    ``num_reqs`` requests: ``positions [T]`` (``[3, T]`` with M-RoPE), ``slot_mapping [T]``
    (-1: no write), ``block_table [num_reqs, max_blocks_per_seq]`` (and with several KV-cache
    groups one more of each per group, ``AttentionMetadata.group_metadata``); a subclass adds
    its ``query_start_loc`` and ``seq_lens``.
    """

    kind = ""

    def __init__(
        self,
        model: torch.nn.Module,
        sizes,
        max_model_len: int,
        block_size: int,
        num_reqs,
        device,
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.model = model
        self.sizes = tuple(sorted(sizes))
        self.max_model_len = max_model_len
        self.device = device
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        t = self.sizes[-1]
        # [3 * T] with M-RoPE: the [3, size] positions of each size are its contiguous head.
        self.positions = torch.zeros(
            3 * t if self.uses_mrope else t, dtype=torch.int64, device=device
        )
        max_blocks = -(-max_model_len // block_size)
        groups = range(num_kv_cache_groups)
        self.slot_mappings = [
            torch.full((t,), -1, dtype=torch.int64, device=device) for _ in groups
        ]
        self.block_tables = [
            torch.zeros((num_reqs, max_blocks), dtype=torch.int32, device=device) for _ in groups
        ]
        self.slot_mapping, self.block_table = self.slot_mappings[0], self.block_tables[0]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [size, hidden] hidden states, in the pool
        self.num_replays = 0

    def _call(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    def _positions(self, size: int) -> torch.Tensor:
        return (
            self.positions[: 3 * size].view(3, size) if self.uses_mrope else self.positions[:size]
        )

    def _fill(self, positions: torch.Tensor, metadata: AttentionMetadata, size: int) -> None:
        """Copy the step's positions, slot mapping (-1 up to ``size``), seq_lens and block
        table into the static buffers."""
        n, r = metadata.num_tokens, metadata.num_reqs
        if self.uses_mrope:
            mrope = positions if positions.ndim == 2 else positions.expand(3, -1)
            self._positions(size)[:, :n].copy_(mrope)
        else:
            self.positions[:n].copy_(positions)
        self.seq_lens[:r].copy_(metadata.seq_lens)
        for group, (slots, table) in enumerate(
            zip(self.slot_mappings, self.block_tables, strict=True)
        ):
            step = metadata.for_group(group)
            slots[:n].copy_(step.slot_mapping)
            slots[n:size].fill_(-1)
            table[:r, : step.block_table.shape[1]].copy_(step.block_table)

    def _metadata(self, size: int) -> AttentionMetadata:
        """The step metadata over the static buffers of the graph of ``size``, group 0's."""
        raise NotImplementedError

    def _buffer_metadata(
        self, size: int, num_reqs: int, max_query_len: int, host_copies: tuple[list, list]
    ) -> AttentionMetadata:
        """Metadata over the first ``size`` token rows and ``num_reqs`` request rows of the
        static buffers (group 0's). ``host_copies``: ``(query_start_loc_cpu, seq_lens_cpu)``."""
        query_start_loc_cpu, seq_lens_cpu = host_copies
        return AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            max_query_len=max_query_len,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )

    def _step_metadata(self, size: int) -> AttentionMetadata:
        """``_metadata(size)`` with the other KV-cache groups' buffers."""
        metadata = self._metadata(size)
        r = metadata.num_reqs
        metadata.group_metadata = tuple(
            dataclasses.replace(metadata, slot_mapping=slots[:size], block_table=table[:r])
            for slots, table in zip(self.slot_mappings[1:], self.block_tables[1:], strict=True)
        )
        return metadata

    def capture(self, pool=None) -> None:
        """Capture one graph per size (largest first) into ``pool`` (a fresh one if None)."""
        start = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._call(size)  # warm-up: compiles the Triton kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            self.outputs[size] = capture_graph(graph, pool, functools.partial(self._call, size))
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "Captured %d CUDA graphs for %s %s in %.1f s.",
            len(self.sizes),
            self.kind,
            list(self.sizes),
            time.perf_counter() - start,
        )

    def _replay(self, size: int, num_tokens: int) -> torch.Tensor:
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:num_tokens]


class CudaGraphRunner(_GraphFamily):
    """Captures the LM forward for each decode batch size and replays it.

    ``model(input_ids, positions, attn_metadata)`` is captured with static buffers of
    ``max(sizes)`` rows: ``input_ids [B]``, ``positions [B]`` (``[3, B]`` with M-RoPE),
    ``slot_mapping [B]``, ``seq_lens [B]``, ``block_table [B, max_blocks_per_seq]``,
    ``query_start_loc [B + 1]`` (always ``arange``: one token per request). ``num_replays``
    counts replays.
    """

    kind = "decode batch sizes"

    def __init__(
        self,
        model: torch.nn.Module,
        sizes: tuple[int, ...],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        num_kv_cache_groups: int = 1,
    ) -> None:
        n = max(sizes)
        super().__init__(model, sizes, max_model_len, block_size, n, device, num_kv_cache_groups)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the first ``size`` rows of the static buffers (worst-case lengths)."""
        return self._buffer_metadata(size, size, 1, (list(range(size + 1)), [1] * size))

    def _call(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self._positions(size), self._step_metadata(size))

    def can_run(self, num_reqs: int) -> bool:
        return 0 < num_reqs <= self.max_batch_size

    def run(
        self,
        input_ids: torch.Tensor,  # [num_reqs] int64 (device)
        positions: torch.Tensor,  # [num_reqs] or [3, num_reqs] int64 (device)
        attn_metadata: AttentionMetadata,  # of the real rows (num_tokens == num_reqs)
    ) -> torch.Tensor:
        """Copy the step into the static buffers, replay the padded graph; ``[num_reqs, hidden]``
        (a view of the graph's output: valid until the next replay)."""
        num_reqs = attn_metadata.num_reqs
        size = padded_batch_size(num_reqs, self.sizes)
        self.input_ids[:num_reqs].copy_(input_ids)
        self._fill(positions, attn_metadata, size)
        # Rows num_reqs..size are padding: slot -1 and seq_len 1 (the block table rows may
        # hold stale, still valid, block ids: only read, never written).
        self.seq_lens[num_reqs:size].fill_(1)
        return self._replay(size, num_reqs)


class MixedCudaGraphRunner(_GraphFamily):
    """Captures the LM forward from input embeddings for each step size in tokens.

    ``forward(positions, inputs_embeds, attn_metadata)`` (``worker.compile.lm_forward``:
    compiled at level 2) is captured over static buffers
    of ``T = max(sizes)`` tokens and ``R = min(T, max_num_reqs)`` requests: ``inputs_embeds
    [T, inputs_embeds_size]``, ``positions [T]`` (``[3, T]`` with M-RoPE), ``slot_mapping [T]``,
    ``query_start_loc [R + 1]``, ``seq_lens [R]``, ``block_table [R, max_blocks_per_seq]``.
    The graph of ``size`` tokens serves any step of at most ``size`` tokens (and so at most
    ``min(size, max_num_reqs)`` requests); see the module doc for its padding.
    """

    kind = "steps of token counts"

    def __init__(
        self,
        model: torch.nn.Module,
        forward: LMForward,
        sizes: tuple[int, ...],
        max_model_len: int,
        block_size: int,
        max_num_reqs: int,
        inputs_embeds_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_cache_groups: int = 1,
    ) -> None:
        t = max(sizes)
        self.max_num_reqs = max_num_reqs
        r = self._num_reqs(t)
        super().__init__(model, sizes, max_model_len, block_size, r, device, num_kv_cache_groups)
        self.forward = forward
        self.inputs_embeds = torch.zeros((t, inputs_embeds_size), dtype=dtype, device=device)
        self.query_start_loc = torch.zeros(r + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(r, dtype=torch.int32, device=device)

    def _num_reqs(self, size: int) -> int:
        """The request capacity of the graph of ``size`` tokens."""
        return min(size, self.max_num_reqs)

    def _metadata(self, size: int) -> AttentionMetadata:
        r = self._num_reqs(size)
        # max_query_len ``size``: the prefill launch config, whatever the step's lengths; the
        # host copies serve only the CPU references.
        return self._buffer_metadata(size, r, size, ([0] * (r + 1), [0] * r))

    def _call(self, size: int) -> torch.Tensor:
        return self.forward(
            self._positions(size), self.inputs_embeds[:size], self._step_metadata(size)
        )

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured size that serves a step of ``num_tokens`` tokens, or None."""
        return padded_batch_size(num_tokens, self.sizes) if num_tokens > 0 else None

    def run(
        self,
        inputs_embeds: torch.Tensor,  # [num_tokens, inputs_embeds_size]
        positions: torch.Tensor,  # [num_tokens] or [3, num_tokens] int64 (device)
        attn_metadata: AttentionMetadata,  # of the real step
    ) -> torch.Tensor:
        """Copy the step into the static buffers, replay the padded graph; ``[num_tokens,
        hidden]`` (a view of the graph's output: valid until the next replay)."""
        n, r = attn_metadata.num_tokens, attn_metadata.num_reqs
        size = self.padded_size(n)
        capacity = self._num_reqs(size)
        self.inputs_embeds[:n].copy_(inputs_embeds)
        self._fill(positions, attn_metadata, size)
        self.query_start_loc[: r + 1].copy_(attn_metadata.query_start_loc)
        self.query_start_loc[r + 1 : capacity + 1].fill_(n)  # empty padding requests
        return self._replay(size, n)


@torch.inference_mode()  # static buffers as the steps' tensors: one compiled graph serves both
def capture_graphs(
    model: torch.nn.Module, forward: LMForward, config: EngineConfig
) -> tuple[CudaGraphRunner | None, MixedCudaGraphRunner | None]:
    """Capture the decode graphs of ``model`` (its KV cache bound) and the mixed-step graphs
    of ``forward`` into one pool, and launch the GEMM kernels of the steps that run eagerly
    (``worker.gemm_warmup``). ``(None, None)`` where ``graphs_enabled`` says no."""
    compilation, model_config, device = config.compilation, config.model, config.device
    if not graphs_enabled(config):
        return None, None
    pool = torch.cuda.graph_pool_handle()
    max_model_len, block_size = model_config.max_model_len, config.cache.block_size
    decode = mixed = None
    groups = kv_cache_layout(model_config.hf_config).num_groups
    if compilation.cuda_graph_batch_sizes:
        sizes = compilation.cuda_graph_batch_sizes
        decode = CudaGraphRunner(model, sizes, max_model_len, block_size, device, groups)
        decode.capture(pool)
    if compilation.cuda_graph_num_tokens:
        mixed = MixedCudaGraphRunner(
            model,
            forward,
            compilation.cuda_graph_num_tokens,
            max_model_len,
            block_size,
            config.scheduler.max_num_seqs,
            model.inputs_embeds_size,  # the LM's hidden size, or wider (Qwen3-VL's DeepStack)
            model_config.dtype,
            device,
            groups,
        )
        mixed.capture(pool)
    scheduler = config.scheduler
    warm_gemm_kernels(model, scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    return decode, mixed


def graphs_enabled(config: EngineConfig) -> bool:
    """Whether steps replay CUDA graphs: on CUDA, above compilation level 0, unless the
    kernels are forced to the host-looping references (``--kernel-mode ref``)."""
    from mm_serve.kernels import kernel_mode

    if config.compilation.enforce_eager or config.device.type != "cuda":
        return False
    if kernel_mode() == "ref":
        logger.info("No CUDA graphs: kernel mode ref runs host-side loops.")
        return False
    return True


@torch.inference_mode()
def capture_tower_graphs(model: torch.nn.Module, config: EngineConfig) -> None:
    """Send ``model``'s vision tower, if it has one, through the tower's graphs
    (``tower_runner``, ``worker.tower_graphs``), capturing photo-sized chunks now. The tower
    reads no KV cache, so this runs before the cache is sized: the graphs' pool and the
    activations of their warm-up forwards then count as memory in use, and the KV cache gets
    what is left (captured after it, they would have only the headroom that
    ``gpu_memory_utilization`` leaves, too little for a 7B tower's chunks)."""
    if hasattr(model, "tower_runner") and graphs_enabled(config):
        model.tower_runner = EncoderCudaGraphs(model.visual)
        model.tower_runner.capture_photos()
