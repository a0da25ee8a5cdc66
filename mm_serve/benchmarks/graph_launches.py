"""How long the host spends launching work while the device is busy: is a step's host time its
own work, or a wait for the device?

A py-spy profile of the engine core counts the seconds spent inside a launch as host time. On
CUDA a launch can block, though: past a bounded queue of pending launches, the next one waits
for the device to drain. This script measures, on a busy device (``torch.cuda._sleep``):

- ``queue``: how many eager launches are taken before one blocks; whether 400 replays of a
  400-kernel graph block; how many eager launches are taken after three replays; whether a
  graph's replay waits for its own previous replay to finish; how many
  eager cuBLAS GEMMs and Triton kernels (with and without PDL) are taken; whether replays of
  graphs of cuDNN attention, of a Triton kernel or of cuBLAS GEMMs block, and of one cuDNN call
  among 400 adds; whether pinned host memory (a new block of the caching host allocator, a
  cached one, a new one copied to the device) waits for the device;
- ``first replay``: host and device ms of a fresh graph's first three replays (the first one
  also uploads the graph);
- ``engine``: every CUDA graph replay during one warm ``bench throughput``-style batch (the
  engine core in this process): host ms per replay, by caller, and how many found the device
  still busy with earlier work (an event recorded just before the replay not yet done), and
  the caching allocator's retries (each frees cached blocks after a synchronisation) and
  device allocations during the batch.

    python -m mm_serve.benchmarks.graph_launches --model-arch qwen2-vl-2b --image-size 448 448 \\
        --max-model-len 4096 --output-len 128
"""

from __future__ import annotations

import collections
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

from mm_serve import SamplingParams
from mm_serve.benchmarks import common
from mm_serve.config import KernelConfig
from mm_serve.kernels.dispatch import configure_kernels
from mm_serve.kernels.triton_activation import quick_gelu_triton, silu_and_mul_triton

BUSY_CYCLES = int(2e9)  # about a second of device time at H100/H200 clocks


def capture(body) -> torch.cuda.CUDAGraph:
    """A graph of ``body()``, run once eagerly first (as the engine warms up)."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
        with torch.cuda.graph(graph):
            body()
    torch.cuda.synchronize()
    return graph


def busy_device() -> None:
    """Wait for the device, then keep it busy for about a second (a sleep kernel)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)


def cudnn_attention() -> Callable[[], torch.Tensor]:
    """One cuDNN attention call on the tower's photo-chunk shape (16 images of 1,024 patches,
    16 heads of 80, bf16), as a function to call or capture."""
    q = torch.randn(16, 16, 1024, 80, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, False)


def launches_before_block(launch, limit: int) -> int | None:
    """On a busy device: how many ``launch()`` calls return before one takes over 2 ms."""
    busy_device()
    blocked = None
    for i in range(limit):
        start = time.perf_counter()
        launch()
        if blocked is None and time.perf_counter() - start > 2e-3:
            blocked = i
    torch.cuda.synchronize()
    return blocked


def host_ms(call, running=busy_device) -> float:
    """Host ms of ``call()`` launched while ``running()`` keeps the otherwise idle device busy
    (by default a sleep kernel of about a second)."""
    torch.cuda.synchronize()
    running()
    start = time.perf_counter()
    call()
    elapsed = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return elapsed


def queue_rows(nodes: int = 400) -> list[str]:
    """Eager launches and replays of a graph of ``nodes`` adds taken on a busy device."""
    x = torch.zeros(1024, device="cuda")
    x.add_(1)  # loads the kernel: a lazily loaded one waits for the busy device

    def body():
        for _ in range(nodes):
            x.add_(1)

    graph = capture(body)
    graph.replay()

    def eager_after_replays():
        for _ in range(3):
            graph.replay()
        return launches_before_block(lambda: x.add_(1), 3000)

    torch.cuda.synchronize()
    return [
        f"eager launches before one blocks: {launches_before_block(lambda: x.add_(1), 3000)}",
        f"replays of a {nodes}-kernel graph before one blocks (of 400): "
        f"{launches_before_block(graph.replay, 400)}",
        f"eager launches before one blocks, after 3 replays: {eager_after_replays()}",
    ]


def eager_kernel_rows(limit: int = 3000) -> list[str]:
    """Eager launches taken on a busy device before one blocks, per kind of kernel an encode
    step's LM launches eagerly: a cuBLAS GEMM, a Triton kernel with and without programmatic
    dependent launch (``kernels.pdl``), and an add (one place each: 1,021)."""
    x = torch.randn(256, 2560, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2560, 2560, device="cuda", dtype=torch.bfloat16)
    calls = [  # (name, call, programmatic dependent launch on)
        ("cuBLAS GEMM", lambda: x @ w.T, False),
        ("Triton SiLU-and-mul, PDL", lambda: silu_and_mul_triton(x), True),
        ("Triton SiLU-and-mul, no PDL", lambda: silu_and_mul_triton(x), False),
        ("add", lambda: x.add_(1), False),
    ]
    rows = []
    for name, call, pdl in calls:
        configure_kernels(KernelConfig(pdl=pdl))
        call()  # loads the kernel: a lazily loaded one waits for the busy device
        torch.cuda.synchronize()
        blocked = launches_before_block(call, limit)
        rows.append(f"eager {name} launches before one blocks: {blocked}")
    configure_kernels(KernelConfig.from_env())
    return rows


def in_flight_rows(cycles: int = BUSY_CYCLES // 20) -> list[str]:
    """Host ms of a graph's replay launched while its previous replay still runs on the device,
    against a replay of a second graph of the same body, and against a replay queued behind
    an eager kernel: does a launch wait for the same graph's last launch to finish? (The
    engine replays one graph per step size, so step n + 1's replay may meet step n's.) Each
    graph holds one sleep kernel of ``cycles`` (about 50 ms)."""
    first, second = (capture(lambda: torch.cuda._sleep(cycles)) for _ in range(2))
    cases = {  # what runs: (the replay timed, what the device runs meanwhile)
        "the same graph": (first.replay, first.replay),
        "another graph": (second.replay, first.replay),
        "the graph behind an eager sleep": (first.replay, lambda: torch.cuda._sleep(cycles)),
    }
    return [
        f"replay of a 50 ms graph while {name} runs: {host_ms(*case):.3f} ms of host time"
        for name, case in cases.items()
    ]


def kernel_graph_rows(calls: int = 32, replays: int = 100, warm: int = 1) -> list[str]:
    """Replays before one blocks, on a busy device, of a graph of ``calls`` calls of the
    kernels the tower's graphs hold and the synthetic ones do not: cuDNN's attention (16
    images of 1,024 patches, 16 heads of 80), a Triton kernel (QuickGELU) and a cuBLAS GEMM
    (the tower's fc2 over four photos), each graph
    first replayed ``warm`` times on an idle device (does a graph launch differently once it
    has run many times, as the engine's have by a later batch?)."""
    x = torch.randn(4096, 5120, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1280, 5120, device="cuda", dtype=torch.bfloat16)
    bodies = {
        "cuDNN attention": cudnn_attention(),
        "Triton QuickGELU": lambda: quick_gelu_triton(x),
        "cuBLAS GEMM (4096 x 5120 x 1280)": lambda: x @ w.T,
    }
    rows = []
    for name, call in bodies.items():
        graph = capture(lambda call=call: [call() for _ in range(calls)])
        for _ in range(warm):
            graph.replay()
            torch.cuda.synchronize()
        blocked = launches_before_block(graph.replay, replays)
        rows.append(
            f"replays of a graph of {calls} {name} calls (run {warm} times before) before one "
            f"blocks: {blocked}"
        )
    return rows


def pinned_rows(size: int = 15 << 20) -> list[str]:
    """Host ms of pinned host memory on a busy device: a block the caching host allocator must
    create (``cudaHostAlloc``), the same size again once that block is free, and a fresh
    block's non-blocking copy to the device (the engine's staging of a step's pixels)."""

    def new_block(size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    fresh = host_ms(lambda: new_block(size))  # the allocator has no block of this size
    cached = host_ms(lambda: new_block(size))  # the first one, freed and idle
    copied = host_ms(lambda: new_block(2 * size).to("cuda", non_blocking=True))
    return [
        f"a new {size >> 20} MiB pinned block: {fresh:.2f} ms; the cached one: {cached:.3f} ms; "
        f"a new {2 * size >> 20} MiB block and its copy to the device: {copied:.2f} ms"
    ]


def mixed_graph_rows(adds: int = 400, replays: int = 100) -> list[str]:
    """Replays before one blocks, on a busy device, of a graph of one cuDNN attention call
    among ``adds`` adds (as a tower graph holds one per block among its other kernels): do
    only the cuDNN nodes take places in the launch queue, or every node of such a graph?"""
    attention, x = cudnn_attention(), torch.zeros(1024, device="cuda")

    def body():
        for i in range(adds):
            x.add_(1)
            if i == adds // 2:
                attention()

    graph = capture(body)
    graph.replay()
    blocked = launches_before_block(graph.replay, replays)
    return [
        f"replays of a graph of 1 cuDNN attention call and {adds} adds before one blocks: {blocked}"
    ]


def first_replay_rows(matmuls: int = 20, adds: int = 20) -> list[str]:
    """A fresh graph of ``matmuls`` bf16 2048^3 GEMMs, each followed by ``adds`` adds."""
    x = torch.zeros(1024, device="cuda")
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def body():
        for _ in range(matmuls):
            a @ a
            for _ in range(adds):
                x.add_(1)

    graph, cells = capture(body), []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        host = time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        cells.append(f"host {host * 1e3:.3f} / device {start.elapsed_time(end):.3f}")
    return [f"replays 1-3 of a fresh {matmuls * (adds + 1)}-kernel graph, ms: " + "; ".join(cells)]


def engine_rows(args) -> list[str]:
    """Every graph replay of one warm batch of ``args``' workload, by caller."""
    replays: dict[str, list[tuple[float, bool]]] = collections.defaultdict(list)
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph):
        before = torch.cuda.Event()
        before.record()
        start = time.perf_counter()
        replay(graph)
        seconds = time.perf_counter() - start
        caller = traceback.extract_stack(limit=2)[0]
        replays[f"{caller.filename.rsplit('/', 1)[-1]}:{caller.name}"].append(
            (seconds, not before.query())
        )

    with tempfile.TemporaryDirectory() as workdir:
        llm = common.in_process_llm(args, workdir)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        batch = common.warm_preprocessed_batch(llm, args, params)
        torch.cuda.CUDAGraph.replay = timed_replay
        try:
            before = torch.cuda.memory_stats()
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            wall = time.perf_counter() - start
            after = torch.cuda.memory_stats()
        finally:
            torch.cuda.CUDAGraph.replay = replay
            common.shutdown(llm)
    allocator = {k: after[k] - before[k] for k in ("num_alloc_retries", "num_device_alloc")}
    rows = [f"warm batch: {wall * 1e3:.0f} ms; caching allocator: {allocator}"]
    for caller, runs in replays.items():
        ms = [seconds * 1e3 for seconds, _ in runs]
        num_busy = sum(busy for _, busy in runs)
        rows.append(
            f"{caller}: {len(ms)} replays, {sum(ms):.1f} ms in all, median "
            f"{statistics.median(ms):.2f}, max {max(ms):.2f}; device busy at {num_busy}"
        )
    return rows


def main() -> None:
    args = common.profile_parser(__doc__, output_len=1).parse_args()
    for title, rows in (
        (
            "queue (device busy)",
            queue_rows()
            + in_flight_rows()
            + eager_kernel_rows()
            + kernel_graph_rows()
            + kernel_graph_rows(warm=50)
            + mixed_graph_rows()
            + pinned_rows(),
        ),
        ("first replay", first_replay_rows()),
        ("engine", engine_rows(args)),
    ):
        print(f"\n{title}")
        for row in rows:
            print(f"  {row}")


if __name__ == "__main__":
    main()
