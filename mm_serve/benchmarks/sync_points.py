"""Where the engine's steps make the host wait for the device, by source line.

A synchronising call (``.item()``, ``.tolist()`` of a device tensor, a blocking copy to the
host, ``nonzero`` and boolean-mask indexing on the device) stalls the host until every queued
kernel is done; the device then idles while the host launches what follows. This script runs
one ``bench throughput``-style batch warm in this process (the engine core in-process), with
``torch.cuda.set_sync_debug_mode("warn")`` on for the timed batch only, and prints each line
of Python that synchronised, with its count. Some synchronisations are meant (a step reads its
sampled tokens behind an event, outside the launch); the rest show where a step's launch
waits.

    python -m mm_serve.benchmarks.sync_points --model-arch qwen2-vl-2b --image-size 448 448 \\
        --max-model-len 4096 --output-len 4
"""

from __future__ import annotations

import collections
import tempfile
import warnings

import torch

from mm_serve.benchmarks import common


def main() -> None:
    parser = common.profile_parser(__doc__, output_len=4)
    args = parser.parse_args()
    from mm_serve import SamplingParams

    with tempfile.TemporaryDirectory() as workdir:
        llm = common.in_process_llm(args, workdir)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        batch = common.warm_preprocessed_batch(llm, args, params)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            llm.generate(batch, params, use_tqdm=False)
            torch.cuda.set_sync_debug_mode("default")
        common.shutdown(llm)
    sites = collections.Counter(
        f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    print(f"{sum(sites.values())} synchronising calls at {len(sites)} lines")
    for site, count in sites.most_common():
        print(f"{count:7d}  {site}")


if __name__ == "__main__":
    main()
