"""The vision tower's CUDA graphs over one encode step's images, by how the step is chunked.

An encode step's images go through the tower's graphs in chunks (``worker.tower_graphs``:
largest of ``CHUNK_COUNTS`` first, so 26 photos run as 16 + 8 + 2). A small chunk's GEMMs are
short of rows: Qwen2-VL's ``proj`` and ``fc2`` have 1,280 output features, so a chunk of two
448x448 images (2,048 rows) is a fraction of one wave of output tiles on 132 SMs. This script
times the same images through graphs of other chunkings, in one process:

    python -m mm_serve.benchmarks.tower_chunks [--model-arch qwen2-vl-2b] [--images 26] \
        [--chunks 24+2 ...] [--eager] [--host-ahead]

Each row is one chunking (its chunks' image counts) with the device ms of the whole step
(CUDA events, median of ``--iters``, the rows interleaved) and its ratio to the engine's.
``--eager``: one eager forward over all the images (cuDNN's attention in ``dense_parts``),
timed from an idle device, and again behind a sleeping kernel, so that the host launches ahead
of the device as in a busy engine; ``--host-ahead`` times the graph rows behind the sleeping
kernel too (a graph's launch then overlaps the device's work). ``--kernels NAME ...``: those
rows' kernels (the torch profiler, one call each): name, device ms, calls.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mm_serve.benchmarks.tower_step import build_tower, kernel_table, time_ms
from mm_serve.worker import tower_graphs
from mm_serve.worker.tower_graphs import EncoderCudaGraphs

HOST_AHEAD_CYCLES = 80_000_000  # about 40 ms at 1.98 GHz: longer than launching one forward


def chunkings(images: int) -> list[list[int]]:
    """The engine's chunking of ``images`` photos, then one chunk, two and three even ones."""
    engine = tower_graphs.split_batch([(1, 32, 32)] * images, tower_graphs.DEFAULT_MAX_PATCHES)
    rows = [[count for _, count, _ in engine]]
    for parts in (1, 2, 3):
        size = -(-images // parts)
        rows.append([size] * (parts - 1) + [images - size * (parts - 1)])
    return rows


def chunked_run(tower, sizes: list[int], pixels: torch.Tensor, grid: tuple[int, int, int]):
    """A function running ``pixels`` (same-grid images) through new tower graphs in chunks of
    ``sizes`` images, each chunk one captured graph."""
    patches = grid[0] * grid[1] * grid[2]
    graphs = EncoderCudaGraphs(tower, max_patches=max(sizes) * patches, capture_after=1)
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    saved, counts = tower_graphs.CHUNK_COUNTS, tuple(sorted(set(sizes), reverse=True))

    def run():  # each chunk's count among CHUNK_COUNTS: one chunk, one graph per call
        tower_graphs.CHUNK_COUNTS = counts
        try:
            for first, last in zip(starts, starts[1:], strict=False):
                graphs(pixels[first * patches : last * patches], [grid] * (last - first))
        finally:
            tower_graphs.CHUNK_COUNTS = saved

    run()  # captures
    assert graphs.num_eager == 0 and len(graphs.graphs) == len(set(sizes))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-arch", default="qwen2-vl-2b")
    parser.add_argument("--images", type=int, default=26)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--chunks", nargs="*", default=[], help="More chunkings to time, e.g. 24+2 (image counts)."
    )
    parser.add_argument("--eager", action="store_true", help="Also: one eager forward.")
    parser.add_argument("--host-ahead", action="store_true", help="Graph rows too: see above.")
    parser.add_argument(
        "--kernels", nargs="*", default=[], help="Rows whose kernels to list (profiler)."
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    tower = build_tower(args.model_arch, device).to(torch.bfloat16)
    unit = tower.patch_embed.proj.weight.shape[-1] * tower.spatial_merge_size
    side = args.side // unit * tower.spatial_merge_size  # in patches
    grid, patches = (1, side, side), side * side
    width = tower.patch_embed.proj.weight[0].numel()
    pixels = torch.randn(args.images * patches, width, device=device, dtype=torch.bfloat16)
    sizes = chunkings(args.images) + [[int(n) for n in c.split("+")] for c in args.chunks]
    runs = {"+".join(map(str, s)): chunked_run(tower, s, pixels, grid) for s in sizes}
    if args.eager:
        grids = [list(grid)] * args.images

        @torch.inference_mode()
        def eager():
            return tower.run(pixels, tower.plan(grids, device))

        eager()  # plans its attention's parts (the graphs above built these shapes' too)
        runs["eager"] = runs["eager, host ahead"] = eager
    # Timed behind a sleeping kernel: the device busy while the host launches.
    behind_sleep = {name for name in runs if args.host_ahead and name != "eager"}
    behind_sleep.add("eager, host ahead")
    times = {name: [] for name in runs}
    for _ in range(args.iters):
        for name, run in runs.items():
            if name in behind_sleep:
                torch.cuda._sleep(HOST_AHEAD_CYCLES)
            times[name] += time_ms(run, 1)
    base = None
    print(f"{args.images} images of {args.side}x{args.side}, {torch.cuda.get_device_name()}")
    for name, samples in times.items():
        ms = statistics.median(samples)
        base = base or ms
        print(f"  chunks {name:>27}: {ms:7.2f} ms  ({ms / base:.3f} of the engine's)")
    for name in args.kernels:
        print(f"kernels of {name}:")
        for kernel, ms, calls in kernel_table(runs[name], top=16):
            print(f"  {ms:8.2f} ms {calls:5d}  {kernel[:90]}")


if __name__ == "__main__":
    main()
