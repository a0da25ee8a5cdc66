"""Start-up time of ``mm-serve serve``: seconds from the command to ``GET /health`` == 200.

Serves one architecture folder with random weights (``--load-format dummy``) at each given
compilation level, twice per level: first with empty compile caches, then with the caches
the first start left (``MM_SERVE_CACHE_DIR`` and ``TRITON_CACHE_DIR``, fresh folders per level
and run of this script). Also
prints the seconds the server's log gives for loading the weights, compiling and capturing.

    mm-serve bench startup --model-arch qwen2-vl-2b --levels 1 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from mm_serve.benchmarks.architectures import architecture_names, write_architecture
from mm_serve.benchmarks.peer_serve import server_command, start_server, stop_server

# Log lines whose seconds are reported: (name, pattern with one group of seconds).
LOG_TIMES = (
    ("load_s", r"Loaded the weights in ([\d.]+) s"),
    ("compile_s", r"torch.compile of the LM forward: ([\d.]+) s"),
    ("capture_decode_s", r"Captured \d+ CUDA graphs for decode batch sizes .* in ([\d.]+) s"),
    ("capture_mixed_s", r"Captured \d+ CUDA graphs for steps of token counts .* in ([\d.]+) s"),
)


def log_times(log_path: str) -> dict[str, float]:
    """The seconds of ``LOG_TIMES`` found in the server log (a name is absent if its line is)."""
    text = Path(log_path).read_text()
    return {name: float(m[1]) for name, pattern in LOG_TIMES if (m := re.search(pattern, text))}


LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ (mm_serve\S*): (.*)$")


def timeline(log_path: str, started_at: float) -> list[str]:
    """The server log's ``mm_serve`` lines, each prefixed by its seconds since ``started_at``
    (a wall-clock time), read from the line's timestamp (local time, milliseconds)."""
    lines = []
    for line in Path(log_path).read_text().splitlines():
        if m := LOG_LINE.match(line):
            when = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            lines.append(f"{when - started_at:6.1f} s  {m[2]}: {m[3]}")
    return lines


def time_start(folder: str, level: int, port: int, log_path: str, cache: str) -> dict[str, Any]:
    """Start the server at ``level`` with its caches in ``cache``, stop it once healthy; its
    start-up figures."""
    command = server_command("mm_serve", folder, port, ["--compilation-level", str(level)])
    env = os.environ | {"MM_SERVE_CACHE_DIR": cache, "TRITON_CACHE_DIR": f"{cache}/triton"}
    server = start_server(command, port, log_path, env)
    stop_server(server)
    return {
        "startup_s": round(server.startup_s, 1),
        **log_times(log_path),
        "timeline": timeline(log_path, server.started_at),
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mm-serve bench startup``."""
    parser.add_argument("--model-arch", default="qwen2-vl-2b", choices=architecture_names())
    parser.add_argument("--levels", type=int, nargs="+", default=[2])
    parser.add_argument("--port", type=int, default=8131)
    parser.add_argument("--output-json")
    parser.add_argument("--log-dir", help="Keep the servers' logs here (default: not kept).")


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time each level's first and cached start; prints and returns one result per start."""
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
        folder = os.path.join(workdir, "model")
        write_architecture(args.model_arch, folder)
        for level in args.levels:
            cache = os.path.join(workdir, f"cache-{level}")  # empty before the first start
            for start in ("first", "cached"):
                log_path = os.path.join(args.log_dir or workdir, f"server-{level}-{start}.log")
                result = {"level": level, "start": start}
                result |= time_start(folder, level, args.port, log_path, cache)
                print(json.dumps(result, indent=1), flush=True)
                results.append(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return results
