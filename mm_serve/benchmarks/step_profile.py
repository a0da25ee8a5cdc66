"""Where a decode step's time goes: host phases against the device's time.

Builds ``--model-arch`` with random weights, starts ``--batch-size`` text requests, lets them
reach the decode phase, then times ``--steps`` engine steps phase by phase on the host
(schedule, launch = ``execute_model``, wait = ``PendingOutput.get``, update) in the async
order, and the device time of one decode CUDA graph replay plus logits and sampling alone.
With async scheduling a step costs about max(host, device); without, their sum.

    mm-serve bench step --model-arch qwen2-vl-2b --batch-size 1
    mm-serve bench step --batch-size 63 --mixed 512  # + a mixed step
    mm-serve bench step --batch-size 256 --cprofile 40  # host functions
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import tempfile
import time

import torch

from mm_serve import LLM
from mm_serve.benchmarks import common
from mm_serve.benchmarks.architectures import ARCHITECTURES, write_architecture
from mm_serve.messages.request import Request
from mm_serve.messages.sampling_params import SamplingParams


def host_phases(core, steps: int) -> dict[str, float]:
    """Median ms of each host phase over ``steps`` async-ordered steps (and the whole step)."""
    names = ("schedule", "launch", "wait", "update", "step")
    samples: dict[str, list[float]] = {name: [] for name in names}
    previous = None
    for _ in range(steps):
        t0 = time.perf_counter()
        scheduler_output = core.scheduler.schedule()
        t1 = time.perf_counter()
        pending = core.model_runner.execute_model(scheduler_output)
        t2 = time.perf_counter()
        if previous is not None:
            output = previous[1].get()
            t3 = time.perf_counter()
            core.scheduler.update_from_output(previous[0], output)
        else:
            t3 = t2
        t4 = time.perf_counter()
        previous = (scheduler_output, pending)
        for name, value in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
            samples[name].append(value * 1e3)
    core.scheduler.update_from_output(previous[0], previous[1].get())
    return {name: statistics.median(values) for name, values in samples.items()}


def host_profile(core, steps: int, rows: int) -> str:
    """The cProfile table (``rows`` functions by own time) of ``steps`` more async-ordered
    steps, as ``host_phases`` runs them: where the host's ms per step go, CUDA calls included."""
    profiler = cProfile.Profile()
    profiler.runcall(host_phases, core, steps)
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(rows)
    return stream.getvalue()


def device_time(core, batch_size: int, repeats: int = 50) -> float:
    """Median ms of one decode graph replay + logits + greedy argmax, timed by CUDA events."""
    runner = core.model_runner
    graphs = runner.cuda_graphs
    size = min(s for s in graphs.sizes if s >= batch_size)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.graphs[size].replay()
        runner.model.compute_logits(graphs.outputs[size][:batch_size]).argmax(dim=-1)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[5:])


def kernel_table(core, batch_size: int, rows: int = 25) -> str:
    """The device kernels of one eager decode forward (the graph's inputs) + logits, by time."""
    from torch.profiler import ProfilerActivity, profile

    graphs = core.model_runner.cuda_graphs
    size = min(s for s in graphs.sizes if s >= batch_size)
    model = core.model_runner.model
    with torch.inference_mode():
        for _ in range(3):
            model.compute_logits(graphs._call(size))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.compute_logits(graphs._call(size))
            torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70
    )


def mixed_step(core, prompt_len: int, steps: int = 30) -> tuple[float, float]:
    """Mixed steps: each prefills one fresh ``prompt_len``-token prompt with the running decodes.

    ``steps`` of them run back to back in the async order (schedule and update overlap the
    step before, as ``EngineCore.step`` does). Returns the ms per step of that stream and the
    ms per step of its device kernels and copies (torch profiler, over a second stream).
    """
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    request_ids = (f"mixed{i}" for i in itertools.count())

    def stream(count: int) -> None:
        for _ in range(count):
            request_id = next(request_ids)
            ids = torch.randint(0, 150000, (prompt_len,), generator=gen).tolist()
            core.add_request(Request(request_id, ids, params))
            core.step()
            if core._in_flight:  # async scheduling: the step just launched
                assert core._in_flight[-1][0].num_scheduled_tokens[request_id] == prompt_len

    stream(5)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    stream(steps)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stream(steps)
        torch.cuda.synchronize()
    kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps
    return wall, kernels


def throughput_breakdown(llm, num_prompts: int) -> str:
    """Run ``num_prompts`` 448x448 image requests (128 tokens out) through ``llm.generate`` and
    sum the engine steps' wall time by kind: steps that encode images, other steps with
    prompt tokens, decode-only steps; the rest of the wall time is outside ``step()``."""
    from mm_serve.benchmarks.datasets import random_image_dataset

    core = llm.engine_core
    schedule, step = core.scheduler.schedule, core.step
    kinds: dict[str, list[float]] = {"encode": [], "prefill": [], "decode": []}
    last = {}

    def timed_schedule():
        output = schedule()
        tokens = output.total_num_scheduled_tokens
        last["kind"] = (
            "encode"
            if output.scheduled_encoder_inputs
            else ("decode" if tokens == len(output.num_scheduled_tokens) else "prefill")
        )
        return output

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        kinds[last["kind"]].append(time.perf_counter() - start)
        return outputs

    core.scheduler.schedule, core.step = timed_schedule, timed_step
    requests = random_image_dataset(num_prompts, 50, 128, (448, 448), seed=1)
    prompts = common.image_prompts(requests, llm.config.model.hf_config.model_type)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    lines = [f"{num_prompts} requests in {wall:.3f} s"]
    for kind, times in kinds.items():
        lines.append(f"  {kind:8s} steps {len(times):4d}  {sum(times):.3f} s")
    lines.append(f"  outside step(): {wall - sum(sum(t) for t in kinds.values()):.3f} s")
    return "\n".join(lines)


def encode_step_table(llm, num_images: int = 32, rows: int = 30) -> str:
    """Device kernels and host ops of ``num_images`` 448x448 image prompts prefilled at once
    (vision encoder and prompt prefill), by device time."""
    from torch.profiler import ProfilerActivity, profile

    from mm_serve.benchmarks.datasets import random_image_dataset

    requests = random_image_dataset(num_images, 50, 1, (448, 448), seed=2)
    prompts = common.image_prompts(requests, llm.config.model.hf_config.model_type)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    pending = [llm.input_processor.process(p) for p in prompts]
    for p in pending:  # images preprocessed before the profile
        p.result()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    by_device = averages.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)
    by_host = averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    return by_device + "\n" + by_host


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mm-serve bench step``."""
    parser.add_argument("--model-arch", choices=sorted(ARCHITECTURES), default="qwen2-vl-2b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=306)
    parser.add_argument("--kernels", action="store_true", help="Print the kernel table.")
    parser.add_argument("--encode", action="store_true", help="Profile an image prefill.")
    parser.add_argument(
        "--mixed", type=int, default=0, help="Also time a mixed step: this many prompt tokens."
    )
    parser.add_argument(
        "--throughput", type=int, default=0, help="Also break down N image requests' run."
    )
    parser.add_argument(
        "--cprofile", type=int, default=0, help="Also print the top N host functions."
    )
    parser.add_argument("--compilation-level", type=int, default=2, choices=(1, 2))


def main(args: argparse.Namespace) -> dict[str, float]:
    """Build the engine, start the requests, print the tables; returns the host ms per step of
    each phase and the device ms per decode step (``device_ms``)."""
    folder = write_architecture(args.model_arch, tempfile.mkdtemp())
    llm = LLM(
        folder,
        load_format="dummy",
        max_model_len=4096,
        multiprocess=False,
        compilation_level=args.compilation_level,
    )
    core = llm.engine_core
    common.as_engine_core_process()
    timed_steps = args.steps * (2 if args.cprofile else 1)
    params = SamplingParams(temperature=0.0, max_tokens=timed_steps + 64, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch_size):
        ids = torch.randint(0, 150000, (args.prompt_len,), generator=gen).tolist()
        core.add_request(Request(f"p{i}", ids, params))
    for _ in range(16):  # prefill, then a few decode steps
        core.step()
    phases = host_phases(core, args.steps)
    gpu_ms = device_time(core, args.batch_size)
    print(
        f"{args.model_arch}, batch {args.batch_size}, {torch.cuda.get_device_name()}, "
        f"compilation level {args.compilation_level}"
    )
    print("host ms per step: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    print(f"device ms per decode step (graph replay + logits + argmax): {gpu_ms:.3f}")
    if args.cprofile:
        print(host_profile(core, args.steps, args.cprofile))
    if args.kernels:
        print(kernel_table(core, args.batch_size))
    if args.mixed:
        wall, kernel_sum = mixed_step(core, args.mixed)
        print(
            f"mixed step ({args.mixed}-token prefill + {args.batch_size} decodes): "
            f"{wall:.3f} ms per step in a stream of them, kernels {kernel_sum:.3f} ms, "
            f"ratio {wall / kernel_sum:.2f}"
        )
    if args.encode:
        print(encode_step_table(llm))
    if args.throughput:
        print(throughput_breakdown(llm, 16))  # warm-up
        print(throughput_breakdown(llm, args.throughput))
    return {**phases, "device_ms": gpu_ms}
