"""Where the image workload's encode steps spend their time, phase by phase (a diagnosis).

Runs ``bench throughput``'s workload (one 448x448 image and 18 words per request) through an
in-process engine core and times, in every step that encodes images, the model runner's
phases: ``_update_states``, ``pixels_on_device``, ``encode_images`` (tower included),
``_prepare_inputs``, ``_forward`` and ``sample_tokens``. Each phase is bracketed by device
synchronisations, so the figures are each phase's own host + device time, without the
overlap that async scheduling gives the real run.

    python -m mm_serve.benchmarks.encode_phases --model-arch qwen2-vl-2b --num-prompts 256
"""

from __future__ import annotations

import collections
import functools
import tempfile
import time

import torch

from mm_serve.benchmarks import common


class PhaseTimer:
    """Accumulates synchronised wall times per phase while ``active``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.active = False

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            if self.active:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
            return out

        return timed


def instrument(timer: PhaseTimer) -> None:
    """Wrap the model runner's phases (class attributes: every runner in the process)."""
    import mm_serve.models.qwen2_vl as qwen2_vl
    import mm_serve.worker.model_runner as runner

    launch = timer.wrap("launch_forward (all)", runner.ModelRunner.launch_forward)

    def launch_forward(self, scheduler_output):
        timer.active = bool(scheduler_output.scheduled_encoder_inputs)
        return launch(self, scheduler_output)

    runner.ModelRunner.launch_forward = launch_forward
    runner.encode_images = timer.wrap("encode_images", runner.encode_images)
    qwen2_vl.pixels_on_device = timer.wrap("pixels_on_device", qwen2_vl.pixels_on_device)
    for name in ("_update_states", "_prepare_inputs", "_forward", "sample_tokens"):
        setattr(runner.ModelRunner, name, timer.wrap(name, getattr(runner.ModelRunner, name)))


def main() -> None:
    args = common.profile_parser(__doc__, output_len=4).parse_args()
    from mm_serve import SamplingParams

    timer = PhaseTimer()
    instrument(timer)
    with tempfile.TemporaryDirectory() as workdir:
        llm = common.in_process_llm(args, workdir)
        model_type = llm.config.model.hf_config.model_type

        def prompts(seed: int):
            return common.profile_prompts(args, model_type, seed, args.num_prompts)

        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts(1), params, use_tqdm=False)  # warm-up: shapes, graphs
        timer.seconds.clear()
        timer.calls.clear()
        llm.generate(prompts(2), params, use_tqdm=False)
        common.shutdown(llm)
    for name, seconds in timer.seconds.items():
        calls = timer.calls[name]
        print(f"{name:24} {calls:4d} steps {1e3 * seconds / calls:8.2f} ms each")


if __name__ == "__main__":
    main()
