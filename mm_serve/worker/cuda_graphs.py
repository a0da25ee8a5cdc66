"""CUDA graphs for decode-only steps: one graph per batch size, replayed with padded inputs.

A decode step launches a few hundred small kernels whose CPU launch cost exceeds their GPU
time at small batches; replaying a captured graph launches them all at once. A step is
*decode-only* when every scheduled request has exactly one new token, no image embeddings fall
into the window and no prompt logprobs are wanted; its ``num_reqs`` rows are padded up to the
next captured size (:func:`padded_batch_size`). Other steps, larger ones and CPU run eagerly.

Inside a graph every host-side value is frozen at capture: the kernels read the batch only
from the static device buffers below, which :meth:`CudaGraphRunner.run` fills in place. The
paged-attention launch takes ``max_seq_len = max_model_len`` at capture, so its split-KV
segment count is the worst case; each request splits its own keys over the segments on the
device (``tiles_per_segment = cdiv(num_tiles, NUM_SEGMENTS)``, empty segments get zero
weight in the merge), so the result is right for every length up to ``max_model_len``.

Padding rows are harmless: slot -1 (``reshape_and_cache`` skips negative slots), seq_len 1
and a valid block id (they read one cached token of some block and write nothing); their
outputs are never sampled.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from mm_serve.attention import AttentionMetadata

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


class CudaGraphRunner:
    """Captures the LM forward for each decode batch size and replays it.

    ``model(input_ids, positions, attn_metadata)`` is captured with static buffers of
    ``max(sizes)`` rows: ``input_ids [B]``, ``positions [B]`` (``[3, B]`` with M-RoPE),
    ``slot_mapping [B]``, ``seq_lens [B]``, ``block_table [B, max_blocks_per_seq]``,
    ``query_start_loc [B + 1]`` (always ``arange``: one token per request). All graphs share
    one memory pool, captured largest first; ``num_replays`` counts replays.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sizes: tuple[int, ...],
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.sizes = tuple(sorted(sizes))
        self.max_model_len = max_model_len
        self.device = device
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        pos_shape = (3, n) if self.uses_mrope else (n,)
        self.positions = torch.zeros(pos_shape, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [B, hidden] hidden states, in the pool
        self.num_replays = 0

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the first ``size`` rows of the static buffers (worst-case lengths)."""
        return AttentionMetadata(
            num_reqs=size,
            num_tokens=size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
        )

    def _call(self, size: int) -> torch.Tensor:
        positions = self.positions[:, :size] if self.uses_mrope else self.positions[:size]
        return self.model(self.input_ids[:size], positions, self._metadata(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size (largest first, one shared pool) on padding inputs."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._call(size)  # warm-up: compiles the Triton kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._call(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "Captured %d CUDA graphs for decode batch sizes %s in %.1f s.",
            len(self.sizes),
            list(self.sizes),
            time.perf_counter() - start,
        )

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
        if self.uses_mrope:
            mrope = positions if positions.ndim == 2 else positions.expand(3, -1)
            self.positions[:, :num_reqs].copy_(mrope)
        else:
            self.positions[:num_reqs].copy_(positions)
        self.slot_mapping[:num_reqs].copy_(attn_metadata.slot_mapping)
        self.seq_lens[:num_reqs].copy_(attn_metadata.seq_lens)
        width = attn_metadata.block_table.shape[1]
        self.block_table[:num_reqs, :width].copy_(attn_metadata.block_table)
        # Rows num_reqs..size keep padding values: slot -1 and seq_len 1 (the block table
        # rows may hold stale, still valid, block ids: only read, never written).
        self.slot_mapping[num_reqs:size].fill_(-1)
        self.seq_lens[num_reqs:size].fill_(1)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:num_reqs]
