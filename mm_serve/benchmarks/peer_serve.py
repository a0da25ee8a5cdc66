"""Serving side by side: vLLM's own load generator against mm_serve and vLLM, each fresh.

    mm-serve bench peer-serve --model-arch qwen2-vl-2b --out DIR \
        [--engines mm_serve vllm] [--rates 2 16 32] [--num-prompts 64 384 384]

Writes the architecture folder once (``--load-format dummy``); per engine, starts the server in
its own process group on a free port, waits for ``GET /health`` == 200, runs ``vllm bench serve
--backend openai-chat --dataset-name random-mm`` (one 448x448 image + 50 tokens -> 128 tokens,
``--ignore-eos``, no warm-up) at each rate, and stops it. Both engines get the same requests.

From ``DIR/ENGINE_RATE.json`` it prints the verdicts "mm_serve <= vLLM" per rate, the cold start
(TTFT median of the first 32 requests against the next 32) and the table, all into
``DIR/peer_serve.json``; ``--report-only`` rebuilds the report from ``DIR``. vLLM runs with
``--vllm-pythonpath`` (default ``/tmp/vsite``) first on ``PYTHONPATH`` and
``VLLM_USE_FLASHINFER_SAMPLER=0``."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from mm_serve.benchmarks.architectures import architecture_names, write_architecture
from mm_serve.benchmarks.peer_serve_report import (
    ResultFormatError,
    build_report,
    format_report,
    log_tail,
    result_filename,
)
from mm_serve.distributed.mp_context import free_port, group_members

logger = logging.getLogger(__name__)

ENGINES = ("mm_serve", "vllm")
VLLM_CLI = ["-m", "vllm.entrypoints.cli.main"]
# The workload of ../shared/peer/README.md: one 448x448 image + 50 tokens -> 128 tokens.
WORKLOAD = shlex.split(
    "--dataset-name random-mm --random-input-len 50 --random-output-len 128 "
    "--random-range-ratio 0 --random-mm-base-items-per-request 1 "
    "--random-mm-num-mm-items-range-ratio 0 --random-mm-limit-mm-per-prompt "
    """'{"image":1,"video":0}' --random-mm-bucket-config '{(448, 448, 1): 1.0}' --ignore-eos"""
)
# ---------------------------------------------------------------- servers


def server_command(engine: str, folder: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The command line that serves ``folder`` with random weights on ``port``.

    Raises:
        ValueError: an engine other than ``ENGINES``.
    """
    if engine == "mm_serve":
        command = [sys.executable, "-m", "mm_serve.entrypoints.launch", "serve", folder]
        return [*command, "--load-format", "dummy", "--port", str(port), *extra]
    if engine == "vllm":
        command = [sys.executable, *VLLM_CLI, "serve", folder, "--load-format", "dummy"]
        command += ["--port", str(port), "--max-model-len", "4096"]
        return [*command, "--limit-mm-per-prompt", '{"image":1,"video":0}', *extra]
    raise ValueError(f"Unknown engine {engine!r}; choose from {ENGINES}.")


@dataclass
class ServerProcess:
    """A server subprocess (leader of its own process group), its port and log file;
    ``startup_s``: seconds from the start to ``/health`` answering 200; ``started_at``: the
    start's wall-clock time (``time.time()``)."""

    proc: subprocess.Popen
    port: int
    log_path: str
    startup_s: float = 0.0
    started_at: float = 0.0


def start_server(
    command: list[str],
    port: int,
    log_path: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
) -> ServerProcess:
    """Start ``command`` (a server that listens on ``port``) in a new session, its stdout and
    stderr into ``log_path``, and return once ``GET /health`` answers 200.

    Raises:
        RuntimeError: the server exited, or was not healthy within ``timeout_s`` (then it is
            stopped); the message ends with the log's tail.
    """
    started_at = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = ServerProcess(proc, port, log_path, started_at=started_at)
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            tail = log_tail(log_path)
            raise RuntimeError(f"The server exited with code {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                server.startup_s = time.monotonic() - start
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"The server was not healthy within {timeout_s} s:\n{log_tail(log_path)}")


def port_is_free(port: int) -> bool:
    """Whether a new server could listen on ``port`` (binds it with SO_REUSEADDR, as servers
    do, so connections in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def stop_server(server: ServerProcess, timeout_s: float = 30) -> int:
    """SIGTERM the server's process group, SIGKILL what is left of it after ``timeout_s``,
    then wait until the port is free; returns the server's exit code.

    Raises:
        RuntimeError: the port is still taken 10 s after the group is gone.
    """
    pgid = server.proc.pid

    def running() -> bool:
        return server.proc.poll() is None or bool(group_members(pgid))

    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    if running():
        logger.warning("server %d still running %s s after SIGTERM: killing it", pgid, timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    server.proc.wait()
    deadline = time.monotonic() + 10
    while not port_is_free(server.port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"Port {server.port} is still taken after the server stopped.")
        time.sleep(0.2)
    return server.proc.returncode


# ---------------------------------------------------------------- load generator


def bench_command(
    folder: str, port: int, rate: float, num_prompts: int, result_dir: str, filename: str
) -> list[str]:
    """``vllm bench serve`` with the workload flags, saving its detailed result JSON."""
    command = [sys.executable, *VLLM_CLI, "bench", "serve", "--backend", "openai-chat"]
    command += ["--endpoint", "/v1/chat/completions", "--model", folder, "--port", str(port)]
    command += ["--num-prompts", str(num_prompts), "--request-rate", f"{rate:g}", *WORKLOAD]
    command += ["--save-result", "--save-detailed", "--result-dir", result_dir]
    return [*command, "--result-filename", filename]


def vllm_env(pythonpath: str) -> dict[str, str]:
    """This environment with ``pythonpath`` first on ``PYTHONPATH`` (when not already on it)
    and FlashInfer's sampler off (flashinfer does not travel with the peer)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if pythonpath and pythonpath not in paths:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, *paths])
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def run_engine(engine: str, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start ``engine``'s server fresh, run the load generator at each rate, stop the server;
    returns the server command, its start-up time (s), its exit code (-9: killed after
    ``--shutdown-timeout``) and, when the server did not come up or the load generator exited
    non-zero, the ``error`` with the log's tail. Logs go to
    ``DIR/ENGINE_server.log`` and ``DIR/ENGINE_RATE.log``."""
    port = free_port()
    extra = shlex.split(args.mm_serve_args if engine == "mm_serve" else args.vllm_args)
    command = server_command(engine, folder, port, extra)
    env = vllm_env(args.vllm_pythonpath)
    log = os.path.join(args.out, f"{engine}_server.log")
    info: dict[str, Any] = {"server_command": command}
    try:
        logger.info("starting %s: %s", engine, shlex.join(command))
        server_env = env if engine == "vllm" else None
        server = start_server(command, port, log, server_env, timeout_s=args.startup_timeout)
        info["startup_s"] = server.startup_s
        logger.info("%s healthy after %.1f s", engine, server.startup_s)
        try:
            for rate, num_prompts in zip(args.rates, args.num_prompts, strict=True):
                name = result_filename(engine, rate)
                logger.info("%s at %g req/s, %d prompts", engine, rate, num_prompts)
                bench = bench_command(folder, port, rate, num_prompts, args.out, name)
                run_bench(bench, os.path.join(args.out, name.replace(".json", ".log")), env)
        finally:
            info["server_exit_code"] = stop_server(server, timeout_s=args.shutdown_timeout)
    except (RuntimeError, OSError) as error:
        logger.error("%s failed: %s", engine, error)
        info["error"] = str(error)
    return info


def run_bench(command: list[str], log_path: str, env: dict[str, str]) -> None:
    """Run the load generator's ``command`` with its output into ``log_path``.

    Raises:
        RuntimeError: it exited non-zero (the message ends with the log's tail).
    """
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log_tail(log_path)
        raise RuntimeError(f"vllm bench serve exited with {done.returncode}:\n{tail}")


# ---------------------------------------------------------------- report


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mm-serve bench peer-serve``."""
    add = parser.add_argument
    add("--model-arch", default="qwen2-vl-2b", choices=architecture_names())
    add("--out", required=True, help="Folder for the results and logs.")
    add("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    add("--rates", nargs="+", type=float, default=[2.0, 16.0, 32.0], help="Req/s, in order.")
    add("--num-prompts", nargs="+", type=int, default=[64, 384, 384], help="Per rate.")
    add("--mm-serve-args", default="", help="Extra flags for mm_serve's serve.")
    add("--vllm-args", default="", help="Extra flags for vLLM's serve.")
    add("--vllm-pythonpath", default="/tmp/vsite", help="Where vLLM is installed.")
    add("--startup-timeout", type=float, default=600, help="Seconds for a server's /health.")
    add(
        "--shutdown-timeout",
        type=float,
        default=30,
        help="Seconds a server gets to exit after SIGTERM before it is killed.",
    )
    add("--report-only", action="store_true", help="Only report the JSONs in --out.")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the engines (unless ``--report-only``), print the report, write
    ``DIR/peer_serve.json``; returns the report. An engine that fails is recorded (its
    ``error``) and the next one still runs.

    Raises:
        SystemExit: ``--rates`` and ``--num-prompts`` of different lengths, or a result file
            without a field the report needs (``ResultFormatError``), with the message.
    """
    if len(args.rates) != len(args.num_prompts):
        raise SystemExit("error: --rates and --num-prompts need the same number of values")
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)
    if not args.report_only:
        folder = write_architecture(args.model_arch, os.path.join(args.out, args.model_arch))
        for engine in args.engines:
            for rate in args.rates:  # no stale result of an earlier run is reported
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(args.out, result_filename(engine, rate)))
            info = run_engine(engine, folder, args)
            with open(os.path.join(args.out, f"{engine}_server.json"), "w") as f:
                json.dump(info, f, indent=1)
    try:
        report = build_report(args.out, list(ENGINES), args.rates)
    except ResultFormatError as error:
        raise SystemExit(f"error: {error}") from error
    report.update(model_arch=args.model_arch, rates=args.rates, num_prompts=args.num_prompts)
    with open(os.path.join(args.out, "peer_serve.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(format_report(report))
    return report
