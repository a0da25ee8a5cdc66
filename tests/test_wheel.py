"""The wheel, as a user gets it: ``pip wheel --no-deps .``, installed into a fresh virtual
environment, ``mm-serve serve`` run from a folder outside the checkout serves the bundled demo
model and the upload page, and answers a question about ``example.png``.

The fresh environment sees this interpreter's site-packages folders through a ``.pth`` file
(so the dependencies need no second install) but not its editable ``mm_serve``: a folder named
in a ``.pth`` goes on ``sys.path`` without its own ``.pth`` files, so the editable install's
import hook never runs there."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.server import RemoteServer, assert_group_gone, free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_IMAGE = REPO / "samples" / "demo_vlm" / "example.png"
WEB_FILES = ("index.html", "app.js", "style.css", "favicon.svg")
DEMO_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja")
STARTUP_TIMEOUT_S = 300

# In the fresh environment: where mm_serve comes from, and each requirement of the installed
# distribution (markers evaluated) that is missing or at a version outside its specifier.
CHECK_INSTALL = """
import importlib.metadata as md, json, mm_serve
from packaging.requirements import Requirement
unmet = []
for text in md.requires("mm_serve"):
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        version = None
    if version is None or not req.specifier.contains(version, prereleases=True):
        unmet.append(f"{req} (installed: {version})")
dist = md.distribution("mm_serve")
print(json.dumps({"module": mm_serve.__file__, "metadata": str(dist.locate_file("")),
                  "unmet": unmet}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the checkout's tracked and not-ignored files, built from a copy (a build
    writes ``build/`` beside the sources, and an old ``build/lib`` would leak into the wheel)."""
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in listed)):
        if (REPO / name).is_file():  # a file deleted but not yet staged is listed too
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((REPO / name).read_bytes())
    dist = tmp_path_factory.mktemp("dist")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), "."]
    proc = subprocess.run(pip_wheel, cwd=source, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = dist.glob("mm_serve-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed (no dependencies)."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site_packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    Path(site_packages, "test_environment.pth").write_text("\n".join(ours) + "\n")
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel]
    proc = subprocess.run(install, cwd=root, capture_output=True, text=True, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def clean_env() -> dict[str, str]:
    """This process's environment without ``PYTHONPATH`` (it could name the checkout)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_wheel_holds_the_page_and_the_demo_model_but_no_test_fixtures(wheel) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"mm_serve/web/{name}" for name in WEB_FILES} <= names
    assert {f"mm_serve/demo_model/{name}" for name in DEMO_MODEL_FILES} <= names
    assert [name for name in names if name.startswith("mm_serve/testing/")] == []


def test_fresh_environment_imports_the_wheel_and_has_its_dependencies(venv, tmp_path) -> None:
    proc = subprocess.run(
        [venv / "bin" / "python", "-c", CHECK_INSTALL],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert Path(found["module"]).is_relative_to(venv), found["module"]
    assert Path(found["metadata"]).is_relative_to(venv), found["metadata"]
    assert found["unmet"] == []


class InstalledServer(RemoteServer):
    """``mm-serve serve`` (no model: the demo) from the environment ``venv``, run in the folder
    ``cwd`` on a free port, its log in ``cwd/server.log``; ``RemoteServer`` waits for
    ``/health`` and stops its process group."""

    def __init__(self, venv: Path, cwd: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cwd / "server.log"
        command = [venv / "bin" / "mm-serve", "serve", "--host", "127.0.0.1"]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [*command, "--port", str(self.port)],
                cwd=cwd,
                env=clean_env(),
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        try:
            self._wait_healthy(STARTUP_TIMEOUT_S)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{self.log.read_text()[-3000:]}") from None


@pytest.fixture
def served(venv, tmp_path) -> Iterator[str]:
    """An ``InstalledServer``'s URL; on teardown, checks it exited with 0 and left no process."""
    server = InstalledServer(venv, tmp_path)
    try:
        yield server.url
    finally:
        returncode = server.stop()
        assert_group_gone(server.proc.pid)
    assert returncode == 0, server.log.read_text()[-3000:]


def test_installed_wheel_serves_the_page_and_the_demo_model(served) -> None:
    with httpx.Client(base_url=served, timeout=120) as client:
        page = client.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert page.text == (REPO / "web" / "index.html").read_text()
        assert client.get("/app.js").text == (REPO / "web" / "app.js").read_text()
        assert client.get("/__init__.py").status_code == 404  # the package marker
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["mm-serve-demo-vlm"]

        image = base64.b64encode(EXAMPLE_IMAGE.read_bytes()).decode()
        content = [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
            {"type": "text", "text": "What is in the picture?"},
        ]
        body = {
            "model": "mm-serve-demo-vlm",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 64,
            "temperature": 0,
        }
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["message"]["content"]
    # The demo model describes scenes (shapes, colours, a sign's word), greedily the same way.
    assert answer.startswith("The image shows "), answer
    assert response.json()["choices"][0]["finish_reason"] == "stop"
