"""First answer after ``/health`` against the second, and the server's resident memory.

Starts ``mm-serve serve`` (the bundled demo VLM unless a model is given) on a free port with
this interpreter, waits for ``/health`` to answer 200, then asks two questions about two
different images (so the second gets no cache hit the first did not) and a third about a
third image, and prints their latencies and the resident memory (RSS, and PSS, which counts
pages shared between processes once) of every process of the server: the API server, the
engine core and the preprocessing workers. It stops only the server it started.

    .venv/bin/python samples/startup_metrics.py [MODEL] [-- extra serve flags]

Needs ``psutil`` (``.venv/bin/pip install psutil``).
"""

from __future__ import annotations

import argparse
import base64
import io
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from PIL import Image, ImageOps

EXAMPLE = Path(__file__).resolve().parent / "demo_vlm" / "example.png"
QUESTIONS = ["Describe the image.", "What is in the picture?", "Describe the image."]


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
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": question},
                ],
            }
        ],
        "max_tokens": 64,
        "temperature": 0,
    }
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


def memory_table(pid: int) -> list[tuple[str, int, int]]:
    """(role, RSS bytes, PSS bytes) of the server and each of its descendants."""
    root = psutil.Process(pid)
    rows = []
    for proc in [root, *root.children(recursive=True)]:
        info = proc.memory_full_info()
        cmdline = " ".join(proc.cmdline())
        if proc.pid == pid:
            role = "API server"
        elif "resource_tracker" in cmdline:
            role = "resource tracker"
        elif "forkserver" in cmdline and proc.ppid() == pid:
            role = "forkserver"
        elif any("torchvision" in m.path for m in proc.memory_maps()):
            role = "preprocess worker"  # the engine core never loads torchvision
        else:
            role = "engine core"
        rows.append((f"{role} ({proc.pid})", info.rss, info.pss))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="checkpoint (default: the demo VLM)")
    parser.add_argument("serve_flags", nargs="*", help="more mm-serve serve flags, after --")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", "serve"]
    command += [args.model] if args.model else []
    command += ["--port", str(port), *args.serve_flags]
    start = time.perf_counter()
    server = subprocess.Popen(command)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            wait_healthy(client, server, args.startup_timeout)
            up = time.perf_counter() - start
            answers = [ask(client, image, q) for image, q in zip(images(), QUESTIONS, strict=True)]
            memory = memory_table(server.pid)
    finally:
        server.terminate()
        server.wait(30)
    print(f"\n/health 200 after {up:.1f} s")
    for i, (seconds, text) in enumerate(answers, 1):
        print(f"answer {i}: {seconds * 1000:7.0f} ms  {text!r}")
    print(f"first / second: {answers[0][0] / answers[1][0]:.2f}")
    for role, rss, pss in memory:
        print(f"{role:28s} RSS {rss / 2**20:7.0f} MiB  PSS {pss / 2**20:7.0f} MiB")
    total_rss = sum(r for _, r, _ in memory)
    total_pss = sum(p for _, _, p in memory)
    print(f"{'total':28s} RSS {total_rss / 2**20:7.0f} MiB  PSS {total_pss / 2**20:7.0f} MiB")


if __name__ == "__main__":
    main()
