"""CUDA graphs for the vision tower, one per batch of image grids.

A tower forward over one or a few images is launch-bound: Qwen2-VL's 32 blocks launch some 400
kernels, and on an H100 one 448x448 image took 18 ms of host time to launch 18 ms of device
work. Everything a tower forward does on the host depends only on the images' grids
(``[t, h, w]`` in patches): the rotary tables, the attention segments, the window order. So a
batch is keyed by its grids; the first batch of a key makes the tower's plan (``tower.plan``,
kept for the graph's lifetime), and captures ``tower.run`` over a static pixel buffer; every
later batch of the same key copies its pixels into that buffer and replays. A capture while
serving costs one more tower forward and stalls nothing (``capture_graph``).

Only small batches are graphed (at most ``max_patches`` patches: large batches keep the GPU
busy anyway) and at most ``max_graphs`` keys; the rest run eagerly. Start-up captures batches
of one to four photo-sized images and runs 8 and 16 eagerly (``capture_photos``); other grids
are captured the first time they come. All graphs share one memory pool; each replay's output
is cloned before the next can overwrite it.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from mm_serve.kernels.varlen_attention import MAX_DENSE_BATCH
from mm_serve.worker.graph_capture import capture_graph

logger = logging.getLogger(__name__)

GridsKey = tuple[tuple[int, int, int], ...]

# Batches up to 4 images of 448x448 (1,024 patches each) are graphed; more keep the GPU busy.
DEFAULT_MAX_PATCHES = 4096
DEFAULT_MAX_GRAPHS = 32
# Start-up captures batches of images of this side in pixels (start-up's warm-up sends them).
PHOTO_SIDE = 448


class _TowerGraph:
    """One captured tower forward: its plan, static pixels ``[N, C*T*P*P]`` and output."""

    def __init__(self, tower: nn.Module, grids: GridsKey, pixels: torch.Tensor, pool) -> None:
        self.plan = tower.plan([list(g) for g in grids], pixels.device)
        self.pixels = torch.empty_like(pixels)
        self.pixels.copy_(pixels)
        tower.run(self.pixels, self.plan)  # warm-up: compiles kernels outside the capture
        self.graph = torch.cuda.CUDAGraph()
        self.output = capture_graph(self.graph, pool, lambda: tower.run(self.pixels, self.plan))

    def replay(self, pixels: torch.Tensor) -> torch.Tensor:
        self.pixels.copy_(pixels)
        self.graph.replay()
        return self.output.clone()


class EncoderCudaGraphs:
    """Runs a tower (``plan(grids, device)`` + ``run(pixels, plan)``, as the Qwen2-VL towers
    have) through a CUDA graph per batch of grids (module doc).

    ``__call__(pixel_values [N, C*T*P*P], grids)`` returns what ``tower(pixel_values,
    grid_thw)`` does, ``[N // merge**2, hidden]``; ``grids`` must describe ``pixel_values``
    (the tower's ``check_grid``). ``num_replays`` counts replays, ``num_eager`` eager calls.
    """

    def __init__(
        self,
        tower: nn.Module,
        max_patches: int = DEFAULT_MAX_PATCHES,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
    ) -> None:
        self.tower = tower
        self.max_patches = max_patches
        self.max_graphs = max_graphs
        self.graphs: dict[GridsKey, _TowerGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.num_replays = 0
        self.num_eager = 0

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        key: GridsKey = tuple((int(t), int(h), int(w)) for t, h, w in grids)
        graph = self.graphs.get(key)
        if graph is None and self._graphable(pixel_values):
            graph = self._capture(key, pixel_values)
        if graph is None:
            self.num_eager += 1
            return self.tower.run(pixel_values, self.tower.plan(list(grids), pixel_values.device))
        self.num_replays += 1
        return graph.replay(pixel_values)

    @torch.inference_mode()
    def capture_photos(self, side: int = PHOTO_SIDE, max_images: int = 4) -> None:
        """Capture batches of 1 to ``max_images`` single-frame images of ``side`` x ``side``
        pixels (as the Qwen2-VL processors resize them: sides a multiple of patch * merge),
        within ``max_patches``; and run the tower once on each larger power-of-two batch up to
        ``MAX_DENSE_BATCH`` images, so that the attention plans their batches split into
        (``varlen_attention.dense_parts``) exist before the first request."""
        weight = self.tower.patch_embed.proj.weight  # [dim, C, T, P, P]
        merge = self.tower.spatial_merge_size
        patches = side // (weight.shape[-1] * merge) * merge  # per side
        grid = (1, patches, patches)

        def zeros(count: int) -> torch.Tensor:
            shape = (count * patches**2, weight[0].numel())
            return torch.zeros(shape, dtype=weight.dtype, device=weight.device)

        for count in range(1, max_images + 1):
            pixels = zeros(count)
            if self._graphable(pixels):
                self._capture((grid,) * count, pixels)
        for count in (2**i for i in range(MAX_DENSE_BATCH.bit_length())):
            if count > max_images:
                pixels = zeros(count)
                self.tower.run(pixels, self.tower.plan([list(grid)] * count, pixels.device))

    def _capture(self, key: GridsKey, pixels: torch.Tensor) -> _TowerGraph:
        start = time.perf_counter()
        graph = self.graphs[key] = _TowerGraph(self.tower, key, pixels, self.pool)
        logger.info(
            "Captured the vision tower for grids %s in %.0f ms (%d graphs).",
            list(key),
            1e3 * (time.perf_counter() - start),
            len(self.graphs),
        )
        return graph

    def _graphable(self, pixel_values: torch.Tensor) -> bool:
        return pixel_values.shape[0] <= self.max_patches and len(self.graphs) < self.max_graphs
