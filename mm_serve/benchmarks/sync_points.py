"""Where the engine's steps make the host wait for the device, by source line.

A synchronising call (``.item()``, ``.tolist()`` of a device tensor, a blocking copy to the
host, ``nonzero`` and boolean-mask indexing on the device) stalls the host until every queued
kernel is done; the device then idles while the host launches what follows. This script runs
one ``bench throughput``-style batch in this process (the engine core in-process), warm or,
with ``--first-batch``, the first after start-up, with ``torch.cuda.set_sync_debug_mode("warn")``
on for that batch only, and prints each line that synchronised with the engine's own line that
led to it, and their count. Some synchronisations are meant (a step reads its sampled tokens
behind an event, outside the launch); the rest show where a step's launch waits. Waits that
torch does not check (an event's or the driver's) need ``native_waits``.

    python -m mm_serve.benchmarks.sync_points --model-arch qwen2-vl-2b --image-size 448 448 \\
        --max-model-len 4096 --output-len 4
"""

from __future__ import annotations

import collections
import tempfile
import traceback
import warnings

import torch

from mm_serve.benchmarks import common
from mm_serve.benchmarks.native_waits import is_engine_code


def main() -> None:
    parser = common.profile_parser(__doc__, output_len=4)
    parser.add_argument(
        "--first-batch", action="store_true", help="the first batch after start-up, not a warm one"
    )
    args = parser.parse_args()
    from mm_serve import SamplingParams

    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[f"{filename}:{lineno} from {_engine_caller()}"] += 1

    with tempfile.TemporaryDirectory() as workdir:
        llm = common.in_process_llm(args, workdir)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        if args.first_batch:
            model_type = llm.config.model.hf_config.model_type
            batch = common.profile_prompts(args, model_type, 1, args.num_prompts)
        else:
            batch = common.warm_preprocessed_batch(llm, args, params)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            llm.generate(batch, params, use_tqdm=False)
            torch.cuda.set_sync_debug_mode("default")
        common.shutdown(llm)
    print(f"{sum(sites.values())} synchronising calls at {len(sites)} lines")
    for site, count in sites.most_common():
        print(f"{count:7d}  {site}")


def _engine_caller() -> str:
    """The innermost frame of the engine's own code on the current stack (``native_waits``'
    test), or ``?``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if is_engine_code(frame.filename):
            path = "/".join(frame.filename.rsplit("/", 2)[-2:])
            return f"{path}:{frame.lineno} ({frame.name})"
    return "?"


if __name__ == "__main__":
    main()
