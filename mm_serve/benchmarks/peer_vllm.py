"""vLLM as the peer of ``bench throughput``: the same requests, timed the same way.

``mm-serve bench throughput --peer vllm`` writes the workload to a folder (``write_workload``:
prompt texts as our engine gets them, images as PNG, output lengths) and runs this module in a
subprocess, the only place that imports vllm:

    python3 -m mm_serve.benchmarks.peer_vllm --workload DIR --model FOLDER --output-json OUT

It builds ``vllm.LLM`` on the same folder, warms up, times one ``LLM.generate`` on all requests
(greedy, ``ignore_eos``, ``max_tokens = output_len``) as ``throughput.run_engine`` times ours,
and writes JSON. The caller fails unless vLLM counted the same prompt tokens. ``--peer-bench``
also runs vLLM's ``bench throughput --dataset-name random-mm`` as a cross-check. vLLM is not a
dependency: it is imported from ``--peer-pythonpath`` (e.g. ``/tmp/vsite``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from PIL import Image

from mm_serve.benchmarks import common
from mm_serve.benchmarks.datasets import BenchRequest

logger = logging.getLogger(__name__)

WORKLOAD_FILE = "workload.json"
PEER_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class PeerWorkload:
    """The timed requests and the warm-up requests, each with its prompt text as sent."""

    requests: list[BenchRequest]
    texts: list[str]
    warmup: list[BenchRequest]
    warmup_texts: list[str]


def write_workload(directory: str, workload: PeerWorkload) -> None:
    """Write ``workload`` into ``directory`` (created): ``workload.json`` and ``images/*.png``."""
    os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    groups = {"requests": (workload.requests, workload.texts)}
    groups["warmup"] = (workload.warmup, workload.warmup_texts)
    index: dict[str, list[dict[str, Any]]] = {}
    for group, (requests, texts) in groups.items():
        index[group] = []
        for i, (request, text) in enumerate(zip(requests, texts, strict=True)):
            names = [f"images/{group}-{i:05d}-{j}.png" for j in range(len(request.images))]
            for name, image in zip(names, request.images, strict=True):
                image.save(os.path.join(directory, name), compress_level=1)
            entry = {"prompt": request.prompt, "text": text, "images": names}
            index[group].append({**entry, "output_len": request.output_len})
    with open(os.path.join(directory, WORKLOAD_FILE), "w") as f:
        json.dump(index, f)


def read_workload(directory: str) -> PeerWorkload:
    """The workload ``write_workload`` wrote into ``directory`` (images as RGB PIL images)."""
    with open(os.path.join(directory, WORKLOAD_FILE)) as f:
        index = json.load(f)

    def load(entries: list[dict[str, Any]]) -> tuple[list[BenchRequest], list[str]]:
        requests = []
        for entry in entries:
            images = []
            for name in entry["images"]:
                with Image.open(os.path.join(directory, name)) as image:
                    images.append(image.convert("RGB"))
            requests.append(BenchRequest(entry["prompt"], tuple(images), entry["output_len"]))
        return requests, [entry["text"] for entry in entries]

    return PeerWorkload(*load(index["requests"]), *load(index["warmup"]))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The ``--peer*`` flags of ``bench throughput``."""
    group = parser.add_argument_group("peer engine")
    group.add_argument(
        "--peer",
        choices=["vllm"],
        help="Also run this engine on the same requests (in a subprocess) and report the ratio.",
    )
    group.add_argument(
        "--peer-python",
        default=sys.executable,
        help="The peer's Python interpreter (default: this one).",
    )
    group.add_argument(
        "--peer-pythonpath",
        help="Prepended to PYTHONPATH for the peer's subprocesses only (where vllm is).",
    )
    group.add_argument(
        "--peer-engine-args",
        type=json.loads,
        default={},
        help="More vllm.LLM keyword arguments, as JSON (e.g. '{\"max_num_seqs\": 512}').",
    )
    group.add_argument(
        "--peer-bench",
        action="store_true",
        help="With --peer vllm: also run vLLM's own `bench throughput --dataset-name random-mm` "
        "on the same shapes and report its figure as a cross-check.",
    )


def check_prompt_tokens(ours: int, peer: int) -> None:
    """Raise ``RuntimeError`` unless both engines counted ``ours == peer`` prompt tokens."""
    if ours != peer:
        raise RuntimeError(
            f"bench throughput --peer: vLLM counted {peer} prompt tokens, mm_serve {ours}: the "
            "engines did not get the same requests (tokenizer, prompt texts or image sizes "
            "differ), so their throughputs do not compare."
        )


class PeerRunner:
    """Runs the vLLM driver in a subprocess on a workload written once into ``workdir``."""

    def __init__(
        self, args: argparse.Namespace, folder: str, load_format: str, workdir: str,
        workload: PeerWorkload,
    ) -> None:  # fmt: skip
        self.args, self.folder, self.load_format = args, folder, load_format
        self.workload = workload
        self.directory = os.path.join(workdir, "peer-workload")
        write_workload(self.directory, workload)
        self.num_runs = 0

    def run(self, prompt_tokens: int) -> dict[str, Any]:
        """One fresh vLLM on all requests; its figures. Raises ``RuntimeError`` if it failed or
        counted other than ``prompt_tokens`` (ours) prompt tokens."""
        self.num_runs += 1
        out = os.path.join(self.directory, f"vllm-{self.num_runs}.json")
        command = [
            self.args.peer_python, "-m", "mm_serve.benchmarks.peer_vllm",
            "--workload", self.directory, "--model", self.folder,
            "--load-format", self.load_format, "--seed", str(self.args.seed),
            "--engine-args", json.dumps(self.args.peer_engine_args), "--output-json", out,
        ]  # fmt: skip
        result = self._run(command, out)
        check_prompt_tokens(prompt_tokens, result["prompt_tokens"])
        return result

    def bench(self, prompt_tokens: int, image_tokens: int) -> dict[str, Any]:
        """vLLM's ``bench throughput`` on its random-mm dataset of this workload's shapes: as
        many requests, images of the same size, and text of the rest of our ``prompt_tokens``
        (all requests) after ``image_tokens`` per image. Its figures and command."""
        args, requests = self.args, self.workload.requests
        num_images, output_len = len(requests[0].images), requests[0].output_len
        width, height = requests[0].images[0].size if num_images else (0, 0)
        text_tokens = round(prompt_tokens / len(requests)) - num_images * image_tokens
        limit = json.dumps({"image": num_images, "video": 0})
        out = os.path.join(self.directory, "vllm-bench.json")
        command = [
            args.peer_python, "-m", "vllm.entrypoints.cli.main", "bench", "throughput",
            "--model", self.folder, "--load-format", self.load_format,
            "--num-prompts", str(len(requests)), "--dataset-name", "random-mm",
            "--random-input-len", str(text_tokens), "--random-output-len", str(output_len),
            "--random-range-ratio", "0", "--random-mm-base-items-per-request", str(num_images),
            "--random-mm-num-mm-items-range-ratio", "0", "--random-mm-limit-mm-per-prompt", limit,
            "--random-mm-bucket-config", f"{{({height}, {width}, 1): 1.0}}",
            "--limit-mm-per-prompt", limit, "--max-model-len", str(PEER_MAX_MODEL_LEN),
            "--seed", str(args.seed), "--output-json", out,
        ]  # fmt: skip
        raw = self._run(command, out)
        return {
            "command": command,
            "random_input_len": text_tokens,
            "elapsed_s": raw["elapsed_time"],
            "output_tokens_per_s": raw["num_requests"] * output_len / raw["elapsed_time"],
            "raw": raw,
        }

    def _run(self, command: list[str], out: str) -> dict[str, Any]:
        logger.info("Running the peer: %s", " ".join(command))
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        paths = [self.args.peer_pythonpath, root, env.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        code = subprocess.run(command, env=env, check=False).returncode
        if code != 0:
            raise RuntimeError(f"The vLLM peer exited with code {code} (its log is above).")
        with open(out) as f:
            return json.load(f)


def drive_vllm(
    directory: str, model: str, load_format: str, seed: int, engine_args: dict[str, Any]
) -> dict[str, Any]:
    """Build ``vllm.LLM`` on ``model``, warm it up, time ``generate`` on the workload in
    ``directory``; the figures ``throughput.run_engine`` gives for ours. Raises
    ``RuntimeError`` if a request did not give exactly its ``output_len`` tokens."""
    import vllm

    workload = read_workload(directory)
    output_len = workload.requests[0].output_len
    num_images = max(len(r.images) for r in workload.requests + workload.warmup)
    kwargs = {
        "load_format": load_format,
        "max_model_len": PEER_MAX_MODEL_LEN,
        "limit_mm_per_prompt": {"image": num_images, "video": 0},
        "seed": seed,
        **engine_args,
    }
    llm = vllm.LLM(model, **kwargs)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(common.llm_prompts(workload.warmup, workload.warmup_texts), params, use_tqdm=False)
    prompts = common.llm_prompts(workload.requests, workload.texts)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    figures = common.run_figures(outputs, elapsed, output_len)
    return {"vllm_version": vllm.__version__, "engine_args": kwargs, **figures}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Time vllm.LLM on a written workload.")
    parser.add_argument("--workload", required=True, help="A folder from write_workload.")
    parser.add_argument("--model", required=True, help="The checkpoint folder.")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-args", type=json.loads, default={}, help="JSON kwargs.")
    parser.add_argument("--output-json", required=True)
    args = parser.parse_args(argv)
    result = drive_vllm(args.workload, args.model, args.load_format, args.seed, args.engine_args)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
