"""CUDA graphs for the vision tower, one per batch of image grids.

A tower forward over one or a few images is launch-bound: Qwen2-VL's 32 blocks launch some 400
kernels, and on an H100 one 448x448 image took 18 ms of host time to launch 18 ms of device
work. Everything a tower forward does on the host depends only on the images' grids
(``[t, h, w]`` in patches): the rotary tables, the attention segments, the window order. So a
batch is keyed by its grids; the first batch of a key makes the tower's plan (``tower.plan``,
kept for the graph's lifetime), and captures ``tower.run`` over a static pixel buffer; every
later batch of the same key copies its pixels into that buffer and replays.

Only small batches are graphed (at most ``max_patches`` patches: large batches keep the GPU
busy anyway) and at most ``max_graphs`` keys (the first ones seen); the rest run eagerly. All
graphs share one memory pool; each replay's output is cloned before the next can overwrite it.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

logger = logging.getLogger(__name__)

GridsKey = tuple[tuple[int, int, int], ...]

# Batches up to 4 images of 448x448 (1,024 patches each) are graphed; more keep the GPU busy.
DEFAULT_MAX_PATCHES = 4096
DEFAULT_MAX_GRAPHS = 32


class _TowerGraph:
    """One captured tower forward: its plan, static pixels ``[N, C*T*P*P]`` and output."""

    def __init__(self, tower: nn.Module, grids: GridsKey, pixels: torch.Tensor, pool) -> None:
        self.plan = tower.plan([list(g) for g in grids], pixels.device)
        self.pixels = torch.empty_like(pixels)
        self.pixels.copy_(pixels)
        tower.run(self.pixels, self.plan)  # warm-up: compiles kernels outside the capture
        torch.cuda.synchronize(pixels.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = tower.run(self.pixels, self.plan)

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
            start = time.perf_counter()
            graph = self.graphs[key] = _TowerGraph(self.tower, key, pixel_values, self.pool)
            logger.info(
                "Captured the vision tower for grids %s in %.0f ms (%d graphs).",
                list(key),
                1e3 * (time.perf_counter() - start),
                len(self.graphs),
            )
        if graph is None:
            self.num_eager += 1
            return self.tower.run(pixel_values, self.tower.plan(list(grids), pixel_values.device))
        self.num_replays += 1
        return graph.replay(pixel_values)

    def _graphable(self, pixel_values: torch.Tensor) -> bool:
        return pixel_values.shape[0] <= self.max_patches and len(self.graphs) < self.max_graphs
