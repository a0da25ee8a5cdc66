"""First answer after ``/health`` against the second, and the server's resident memory.

Starts ``mm-serve serve`` (the bundled demo VLM unless a model is given) on a free port with
this interpreter, waits for ``/health`` to answer 200, then asks about three different images
(so no answer gets a cache hit from an earlier one) and times each whole answer. Then it
reads the resident memory of every process of the server: the API server, the engine core
and the preprocessing workers, as RSS and as PSS (which counts the pages processes share,
such as torch's libraries, once). ``--repeat N`` starts N fresh servers and prints the
medians. It stops only the servers it started.

    .venv/bin/python samples/startup_metrics.py [MODEL] [--repeat N] [-- serve flags]

Needs ``psutil`` (in the ``test`` extra that ``make`` installs).
"""

from __future__ import annotations

import argparse
import base64
import io
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from PIL import Image, ImageOps

EXAMPLE = Path(__file__).resolve().parent / "demo_vlm" / "example.png"
QUESTIONS = ["Describe the image.", "What is in the picture?", "Describe the image."]
ENGINE_PID = re.compile(r"engine core is running \(pid (\d+)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def images() -> list[bytes]:
    """The example image, mirrored, and flipped: three images with three content hashes."""
    base = Image.open(EXAMPLE).convert("RGB")
    out = []
    for variant in (base, ImageOps.mirror(base), ImageOps.flip(base)):
        buffer = io.BytesIO()
        variant.save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def ask(client: httpx.Client, image: bytes, question: str) -> tuple[float, str]:
    """(seconds from sending to the whole answer, the answer)."""
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 64, "temperature": 0}
    start = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return time.perf_counter() - start, response.json()["choices"][0]["message"]["content"]


def wait_healthy(client: httpx.Client, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}")
        try:
            if client.get("/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"/health did not answer 200 within {timeout_s} s")


def memory_table(pid: int, engine_pid: int | None) -> list[tuple[str, int, int]]:
    """(role (pid), RSS bytes, PSS bytes) of the server and each of its descendants."""
    root = psutil.Process(pid)
    rows = []
    for proc in [root, *root.children(recursive=True)]:
        cmdline = " ".join(proc.cmdline())
        if proc.pid == pid:
            role = "API server"
        elif proc.pid == engine_pid:
            role = "engine core"
        elif "resource_tracker" in cmdline:
            role = "resource tracker"
        elif "forkserver" in cmdline and proc.ppid() == pid:
            role = "forkserver"
        else:
            role = "preprocess worker"
        info = proc.memory_full_info()
        rows.append((f"{role} ({proc.pid})", info.rss, info.pss))
    return rows


def run_once(args: argparse.Namespace) -> dict:
    """One fresh server: start-up time, the three answers, the memory table."""
    port = free_port()
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", "serve"]
    command += [args.model] if args.model else []
    command += ["--port", str(port), *args.serve_flags]
    start = time.perf_counter()
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    engine_pid: list[int] = []

    def relay_log() -> None:  # pass the server's log through, noting the engine core's pid
        for line in server.stderr:
            sys.stderr.write(line)
            if match := ENGINE_PID.search(line):
                engine_pid.append(int(match.group(1)))

    threading.Thread(target=relay_log, daemon=True).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            wait_healthy(client, server, args.startup_timeout)
            up = time.perf_counter() - start
            answers = [ask(client, image, q) for image, q in zip(images(), QUESTIONS, strict=True)]
            memory = memory_table(server.pid, engine_pid[0] if engine_pid else None)
    finally:
        server.terminate()
        server.wait(30)
    return {"up": up, "answers": answers, "memory": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="checkpoint (default: the demo VLM)")
    parser.add_argument("serve_flags", nargs="*", help="more mm-serve serve flags, after --")
    parser.add_argument("--repeat", type=int, default=1, help="fresh servers to time")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args()
    runs = [run_once(args) for _ in range(args.repeat)]
    print()
    for i, run in enumerate(runs, 1):
        times = " ".join(f"{s * 1000:6.0f}" for s, _ in run["answers"])
        print(f"run {i}: /health after {run['up']:5.1f} s; answers 1 2 3 (ms): {times}")
    firsts = [run["answers"][0][0] for run in runs]
    seconds = [run["answers"][1][0] for run in runs]
    first, second = statistics.median(firsts), statistics.median(seconds)
    print(
        f"median first {first * 1000:.0f} ms, second {second * 1000:.0f} ms: {first / second:.2f}x"
    )
    for i, (_, text) in enumerate(runs[-1]["answers"], 1):
        print(f"answer {i}: {text!r}")
    memory = runs[-1]["memory"]
    for role, rss, pss in memory:
        print(f"{role:28s} RSS {rss / 2**20:7.0f} MiB  PSS {pss / 2**20:7.0f} MiB")
    total_rss, total_pss = sum(r for _, r, _ in memory), sum(p for _, _, p in memory)
    print(f"{'total':28s} RSS {total_rss / 2**20:7.0f} MiB  PSS {total_pss / 2**20:7.0f} MiB")


if __name__ == "__main__":
    main()
