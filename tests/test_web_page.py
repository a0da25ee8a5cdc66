"""The upload page in a real headless Chromium (Playwright driving the system ``chromium``).

Starts ``mm-serve serve`` with its default model (the bundled demo VLM), uploads a generated
scene and asks about it (the answer must be right), then a real photograph in a new
conversation; the answers stream with their timings, and an oversized upload shows a readable
error. A screenshot goes to ``test-artifacts/web_page.png``.
"""

from __future__ import annotations

import importlib
import random
import shutil
import sys
from pathlib import Path

import pytest
from PIL import Image
from test_vlm_vs_hf import photo

from mm_serve.entrypoints.cli import DEMO_MODEL
from mm_serve.testing.server import RemoteServer

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
MAX_PIXELS = 1_000_000
sys.path.insert(0, str(DEMO_MODEL.parent))  # the demo's scene generator (samples/ is no package)
scenes = importlib.import_module("scenes")

playwright_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def server():
    with RemoteServer(str(DEMO_MODEL), ["--max-pixels", str(MAX_PIXELS)]) as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.fail("chromium is not installed (.ci/run installs it with apt-get)")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield browser
        browser.close()


def save(image: Image.Image, path: Path) -> str:
    image.save(path)
    return str(path)


def ask(page, question: str, turn: int) -> str:
    """Type a question, press Enter, wait for the streamed answer's stats; return its text."""
    page.fill("#question", question)
    page.keyboard.press("Enter")
    stats = page.locator(".message.assistant .stats").nth(turn)
    playwright_api.expect(stats).to_contain_text("TTFT", timeout=60_000)
    assert "tokens/s" in stats.inner_text() or "TTFT" in stats.inner_text()
    return page.locator(".message.assistant .text").nth(turn).inner_text().strip()


def test_upload_ask_and_stream(server, browser, tmp_path):
    rng = random.Random(11)
    scene = scenes.generate_scene(rng)
    qa = scenes.ask(scene, "colour", rng)
    page = browser.new_page()
    page.goto(server.url)
    page.wait_for_selector("#model-line:has-text('Model:')")
    page.set_input_files("#file-input", [save(scene.image, tmp_path / "scene.png")])
    playwright_api.expect(page.locator("#previews img")).to_have_count(1)
    assert ask(page, qa.question, 0) == qa.answer
    # A new conversation with the same picture: its prompt tokens come from the cache.
    page.click("#new-chat")
    page.set_input_files("#file-input", [save(scene.image, tmp_path / "again.png")])
    count = scenes.ask(scene, "count", rng)
    assert ask(page, count.question, 0) == count.answer
    stats = page.locator(".message.assistant .stats").nth(0)
    assert "image from cache: yes" in stats.inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web_page.png"), full_page=True)
    # A real photograph, two turns: answers stream in (the demo model knows only its scenes,
    # so their words are not checked).
    page.click("#new-chat")
    page.set_input_files("#file-input", [save(photo("coffee.png"), tmp_path / "coffee.png")])
    assert ask(page, "Describe the image.", 0) not in ("", "…")
    assert ask(page, "What colour is it?", 1) not in ("", "…")
    assert page.locator(".message.user img").count() == 1  # the photo, shown once
    page.close()


def test_oversized_upload_shows_a_readable_error(server, browser, tmp_path):
    big = save(Image.new("RGB", (1200, 1000), "blue"), tmp_path / "big.png")  # 1.2 M pixels
    page = browser.new_page()
    page.goto(server.url)
    page.wait_for_selector("#model-line:has-text('Model:')")
    page.set_input_files("#file-input", [big])
    page.fill("#question", "What is this?")
    page.click("#send")
    error = page.locator("#error")
    playwright_api.expect(error).to_contain_text("above the limit", timeout=30_000)
    # Not an image at all: refused in the page before sending.
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    page.set_input_files("#file-input", [str(text_file)])
    playwright_api.expect(error).to_contain_text("is not an image")
    page.close()
