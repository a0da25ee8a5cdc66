"""The upload page in a real headless Chromium (Playwright driving the system ``chromium``).

Starts the server, uploads a generated scene and a real photograph, asks a question, and checks
that a streamed answer and its timings appear; an oversized upload must show a readable error.
A screenshot goes to ``test-artifacts/web_page.png``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image
from test_vlm_vs_hf import photo

from mm_serve.testing.server import RemoteServer
from mm_serve.testing.vlm_checkpoints import build_tiny_vlm_checkpoint

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
MAX_PIXELS = 1_000_000

playwright_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("web"), family="qwen2_vl", seed=2)
    with RemoteServer(path, ["--max-pixels", str(MAX_PIXELS)]) as server:
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


def test_upload_ask_and_stream(server, browser, tmp_path):
    scene = Image.new("RGB", (224, 224), "white")
    scene.paste(Image.new("RGB", (80, 80), "red"), (20, 30))
    files = [
        save(scene, tmp_path / "scene.png"),
        save(photo("coffee.png"), tmp_path / "coffee.png"),
    ]
    page = browser.new_page()
    page.goto(server.url)
    page.wait_for_selector("#model-line:has-text('Model:')")
    page.set_input_files("#file-input", files)
    expect = playwright_api.expect
    expect(page.locator("#previews img")).to_have_count(2)
    page.fill("#question", "What colour is the square?")
    page.keyboard.press("Enter")
    answer = page.locator(".message.assistant").last
    stats = answer.locator(".stats")
    stats.wait_for(state="visible")
    page.wait_for_function(
        "document.querySelector('.message.assistant .stats').textContent.includes('TTFT')"
    )
    assert answer.locator(".text").inner_text().strip() not in ("", "…")
    assert "tokens/s" in stats.inner_text() and "image from cache" in stats.inner_text()
    # Second turn, same conversation: the images are in the history, so they come from cache.
    page.fill("#question", "And the background?")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.message.assistant .stats').length == 2")
    page.wait_for_function(
        "[...document.querySelectorAll('.message.assistant .stats')][1].textContent"
        ".includes('image from cache: yes')"
    )
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web_page.png"), full_page=True)
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
