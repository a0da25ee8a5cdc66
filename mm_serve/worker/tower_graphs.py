"""CUDA graphs for the vision tower, one per chunk of images of one grid.

An eager tower forward is bound by its ~400 kernel launches. Its host work depends only on the
images' grids (``[t, h, w]`` in patches), so each run of consecutive same-grid images is split
into chunks of ``CHUNK_COUNTS`` images, largest first (27 photos: 16, 8, 3), of at most
``max_patches`` patches; the tower attends within an image, so chunks give the batch's result.
A key (its grids) is captured the ``capture_after``-th time it is met (``tower.plan``, kept for
the graph's lifetime, and ``tower.run`` over the shared static pixel buffer); later chunks copy
their pixels in and replay. Capturing while serving stalls nothing (``capture_graph``).

Every chunk without a graph (key met fewer times, beyond ``max_graphs``, or an image over
``max_patches``) runs in one eager forward over all such images of the batch. Start-up captures
photo-sized chunks (``capture_photos``). All graphs share one memory pool; each replay's output
is copied out before the next can overwrite it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

logger = logging.getLogger(__name__)

GridsKey = tuple[tuple[int, int, int], ...]
T = TypeVar("T")

# Images per graphed chunk, largest first: a run of n images of one grid takes the largest
# that fits, then the rest (the tower's dense attention splits by powers of two alike).
CHUNK_COUNTS = (16, 8, 4, 3, 2, 1)
# A chunk's patches: 16 images of 448x448 (1,024 patches each).
DEFAULT_MAX_PATCHES = 16384
DEFAULT_MAX_GRAPHS = 32
# A key is captured when met this many times: a capture while serving (an eager forward, the
# capture, a cuDNN plan: far more host time than a replay) pays off only for a key that
# recurs; photos of varied sizes rarely do, a pipeline's pages or frames at once.
CAPTURE_AFTER = 4
# At most this many keys without a graph are counted.
MAX_SEEN_KEYS = 4096
# Start-up captures chunks of images of this side in pixels (start-up's warm-up sends them).
PHOTO_SIDE = 448


def capture_graph(graph: torch.cuda.CUDAGraph, pool, fn: Callable[[], T]) -> T:
    """Capture ``fn()`` into ``graph`` (memory from ``pool``) on a side stream; returns its
    result, whose memory the graph owns.

    Unlike ``torch.cuda.graph``, nothing is synchronised and no allocator cache is emptied, so
    a graph can be captured while serving; only this thread is checked for unsafe calls
    (``thread_local``), so the engine's other threads keep working.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            result = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return result


def split_batch(grids: list[tuple[int, int, int]], max_patches: int) -> list[tuple[int, int, bool]]:
    """The chunks a batch of images of ``grids`` (``(t, h, w)`` each, in patches) runs in, in
    order: ``(first image, number of images, graphed)``. Consecutive images of one grid are
    taken ``CHUNK_COUNTS`` at a time, within ``max_patches``; an image over ``max_patches``
    takes its run of same-grid images eagerly in one chunk."""
    chunks, start = [], 0
    while start < len(grids):
        end = start
        while end < len(grids) and grids[end] == grids[start]:
            end += 1
        t, h, w = grids[start]
        if t * h * w > max_patches:
            chunks.append((start, end - start, False))
            start = end
        while start < end:
            count = next(
                c for c in CHUNK_COUNTS if c <= end - start and c * t * h * w <= max_patches
            )
            chunks.append((start, count, True))
            start += count
    return chunks


class _TowerGraph:
    """One captured tower forward over the first rows of the shared static ``pixels``: its
    plan and its output, valid until the next replay of any graph."""

    def __init__(self, tower: nn.Module, grids: GridsKey, pixels: torch.Tensor, pool) -> None:
        self.plan = tower.plan([list(g) for g in grids], pixels.device)
        tower.run(pixels, self.plan)  # warm-up: compiles kernels outside the capture
        self.graph = torch.cuda.CUDAGraph()
        self.output = capture_graph(self.graph, pool, lambda: tower.run(pixels, self.plan))


class EncoderCudaGraphs:
    """Runs a tower (``plan(grids, device)`` + ``run(pixels, plan)``, as the Qwen2-VL towers
    have) through CUDA graphs, a chunk of same-grid images per replay (module doc).

    ``__call__(pixel_values [N, C*T*P*P], grids)`` returns what ``tower(pixel_values,
    grid_thw)`` does, ``[N // merge**2, out]``; ``grids`` must describe ``pixel_values``
    (the tower's ``check_grid``). ``num_replays`` counts replays, ``num_eager`` eager forwards.
    """

    def __init__(
        self,
        tower: nn.Module,
        max_patches: int = DEFAULT_MAX_PATCHES,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        capture_after: int = CAPTURE_AFTER,
    ) -> None:
        self.tower = tower
        self.max_patches = max_patches
        self.max_graphs = max_graphs
        self.graphs: dict[GridsKey, _TowerGraph] = {}
        self.capture_after = capture_after
        self.seen: dict[GridsKey, int] = {}  # how often each key without a graph was met
        self.pool = torch.cuda.graph_pool_handle()
        weight = tower.patch_embed.proj.weight  # [dim, C, T, P, P]
        self.pixels = torch.zeros(  # every graph's input: its first rows
            (max_patches, weight[0].numel()), dtype=weight.dtype, device=weight.device
        )
        self.num_replays = 0
        self.num_eager = 0

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        grids = [(int(t), int(h), int(w)) for t, h, w in grids]
        merge = self.tower.spatial_merge_size
        patch_starts, row_starts = [0], [0]
        for t, h, w in grids:
            patch_starts.append(patch_starts[-1] + t * h * w)
            row_starts.append(row_starts[-1] + t * h * w // merge**2)
        replayed, eager = [], []  # (first image, last image + 1[, graph])
        for first, count, fits in split_batch(grids, self.max_patches):
            last = first + count
            graph = self._graph(tuple(grids[first:last])) if fits else None
            if graph is None:
                eager.append((first, last))
            else:
                replayed.append((first, last, graph))
        if not replayed:  # one eager forward over the whole batch
            return self._eager(pixel_values, grids)
        out = None

        def place(first: int, last: int, rows: torch.Tensor) -> None:  # images first..last-1
            nonlocal out
            if out is None:
                out = rows.new_empty((row_starts[-1], rows.shape[1]))
            out[row_starts[first] : row_starts[last]] = rows

        if eager:  # one eager forward over every image without a graph
            pixels = torch.cat([pixel_values[patch_starts[a] : patch_starts[b]] for a, b in eager])
            rows = self._eager(pixels, [g for a, b in eager for g in grids[a:b]])
            sizes = [row_starts[b] - row_starts[a] for a, b in eager]
            for (a, b), part in zip(eager, rows.split(sizes), strict=True):
                place(a, b, part)
        for a, b, graph in replayed:  # each output copied out before the next replay
            self.pixels[: patch_starts[b] - patch_starts[a]] = pixel_values[
                patch_starts[a] : patch_starts[b]
            ]
            graph.graph.replay()
            self.num_replays += 1
            place(a, b, graph.output)
        return out

    def _graph(self, key: GridsKey) -> _TowerGraph | None:
        """The graph of ``key``: captured when met ``capture_after`` times while room is left
        (until then the key runs eagerly, batched with the step's other such images)."""
        graph = self.graphs.get(key)
        if graph is None and len(self.graphs) < self.max_graphs:
            seen = self.seen.get(key, 0) + 1
            if seen >= self.capture_after:
                self.seen.pop(key, None)
                graph = self._capture(key, sum(t * h * w for t, h, w in key))
            elif key in self.seen or len(self.seen) < MAX_SEEN_KEYS:
                self.seen[key] = seen
        return graph

    def _eager(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """One eager tower forward over images of ``grids``, its attention through
        FlashAttention-2 (images that run once would each build a cuDNN plan)."""
        self.num_eager += 1
        plan = self.tower.plan([list(g) for g in grids], pixels.device, dense=False)
        return self.tower.run(pixels, plan)

    @torch.inference_mode()
    def capture_photos(self, side: int = PHOTO_SIDE) -> None:
        """Capture chunks of each of ``CHUNK_COUNTS`` single-frame images of ``side`` x
        ``side`` pixels (as the Qwen2-VL processors resize them: sides a multiple of patch *
        merge) within ``max_patches``, so that photo batches replay from the first request;
        this also builds the attention plans their chunks use."""
        merge = self.tower.spatial_merge_size
        patches = side // (self.tower.patch_embed.proj.weight.shape[-1] * merge) * merge
        grid = (1, patches, patches)
        for count in CHUNK_COUNTS:
            if count * patches**2 <= self.max_patches:
                self._capture((grid,) * count, count * patches**2)

    def _capture(self, key: GridsKey, num_patches: int) -> _TowerGraph:
        start = time.perf_counter()
        graph = self.graphs[key] = _TowerGraph(
            self.tower, key, self.pixels[:num_patches], self.pool
        )
        logger.info(
            "Captured the vision tower for %d images of grid %s in %.0f ms (%d graphs).",
            len(key),
            list(key[0]),
            1e3 * (time.perf_counter() - start),
            len(self.graphs),
        )
        return graph
