"""How long ``LLM.shutdown`` takes after a batch of the image workload, and whether the engine
core exits on SIGTERM or is killed once the front end's 5 s are up ("ignored SIGTERM; killing
it", seen after ``bench throughput`` on GPU machines).

    python -m mm_serve.benchmarks.shutdown --model-arch qwen2-vl-2b --image-size 448 448 \\
        --max-model-len 4096 --num-prompts 64

Prints the seconds ``shutdown`` took and whether the engine core had to be killed. The engine
core logs how long its own threads and sockets took to stop (``core_proc``).
"""

from __future__ import annotations

import logging
import tempfile
import time

from mm_serve import LLM, SamplingParams
from mm_serve.benchmarks import common


class _Kills(logging.Handler):
    """Counts the front end's warnings that it killed an engine core."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "ignored SIGTERM" in record.getMessage()


def main() -> None:
    args = common.profile_parser(__doc__, output_len=16).parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    kills = _Kills()
    logging.getLogger("mm_serve").addHandler(kills)
    with tempfile.TemporaryDirectory() as workdir:
        folder, load_format = common.model_folder(args, workdir)
        llm = LLM(folder, **common.engine_kwargs(args, load_format, multiprocess=True))
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        model_type = llm.config.model.hf_config.model_type
        prompts = common.profile_prompts(args, model_type, 1, args.num_prompts)
        llm.generate(prompts, params, use_tqdm=False)
        start = time.perf_counter()
        llm.shutdown()
        seconds = time.perf_counter() - start
    killed = "killed after SIGTERM" if kills.count else "exited on SIGTERM"
    print(f"shutdown: {seconds:.2f} s; the engine core {killed}")


if __name__ == "__main__":
    main()
