"""The upload page in a real headless Chromium (Playwright driving the system ``chromium``).

Starts ``mm-serve serve`` with its default model (the bundled demo VLM), uploads a generated
scene and asks about it (the answer must be right), then a real photograph in a new
conversation. Checked: the stats tell the truth (tokens/s only over at least 2 tokens after the
first; "image from cache" from ``usage.prompt_tokens_details.cached_images``, not from a cached
text prefix), a failed turn leaves the view and the history, an unreachable server and a broken
stream give a message and a Retry that works, a server with ``--api-key`` is usable from the
page (401 says "Unauthorized"), and the favicon loads. Screenshots go to ``test-artifacts/``
(``web_page.png``, ``web_page_unreachable.png``).
"""

from __future__ import annotations

import importlib
import random
import re
import shutil
import sys
from pathlib import Path

import pytest
from PIL import Image
from test_vlm_vs_hf import photo

import tests.fixtures.server as server_module
from mm_serve.entrypoints.cli import DEMO_MODEL
from tests.fixtures.server import RemoteServer

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
MAX_PIXELS = 1_000_000
DEMO_DIR = Path(__file__).resolve().parents[1] / "samples" / "demo_vlm"
sys.path.insert(0, str(DEMO_DIR))  # the demo's scene generator (samples/ is no package)
scenes = importlib.import_module("scenes")

playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect


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


def open_page(browser, url: str):
    page = browser.new_page()
    page.goto(url)
    page.wait_for_selector("#model-line:has-text('Model:')")
    return page


def ask(page, question: str, turn: int) -> tuple[str, str]:
    """Type a question, press Enter, wait for the streamed answer's stats; return the answer's
    text and stats."""
    page.fill("#question", question)
    page.keyboard.press("Enter")
    stats = page.locator(".message.assistant .stats").nth(turn)
    expect(stats).to_contain_text("TTFT", timeout=60_000)
    text = page.locator(".message.assistant .text").nth(turn).inner_text().strip()
    return text, stats.inner_text()


def check_rate(stats: str) -> None:
    """tokens/s is shown exactly when at least 2 tokens follow the first."""
    num_tokens = int(re.search(r"(\d+) tokens\b", stats).group(1))
    assert ("tokens/s" in stats) == (num_tokens >= 3), stats


def prefix_hit(stats: str) -> int:
    return int(re.search(r"(\d+) from the prefix cache", stats).group(1))


def test_upload_ask_and_stream(server, browser, tmp_path):
    rng = random.Random(11)
    scene = scenes.generate_scene(rng)
    qa = scenes.ask(scene, "colour", rng)
    page = open_page(browser, server.url)
    failed = []  # no request of the page may fail (the favicon included)
    page.on("response", lambda r: failed.append(r.url) if r.status >= 400 else None)
    page.set_input_files("#file-input", [save(scene.image, tmp_path / "scene.png")])
    expect(page.locator("#previews img")).to_have_count(1)
    answer, stats = ask(page, qa.question, 0)
    assert answer == qa.answer
    assert "image from cache: no" in stats
    check_rate(stats)
    # A new conversation with the same picture: the image comes from the cache.
    page.click("#new-chat")
    page.set_input_files("#file-input", [save(scene.image, tmp_path / "again.png")])
    count = scenes.ask(scene, "count", rng)
    answer, stats = ask(page, count.question, 0)
    assert answer == count.answer
    assert "2 tokens" in stats and "tokens/s" not in stats  # one digit and the end of text
    assert "image from cache: yes" in stats
    answer, stats = ask(page, "Describe the image.", 1)
    assert "tokens/s" in stats and "image from cache: yes" in stats
    check_rate(stats)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web_page.png"), full_page=True)
    # A real photograph, two turns: answers stream in (the demo model knows only its scenes,
    # so their words are not checked).
    page.click("#new-chat")
    page.set_input_files("#file-input", [save(photo("coffee.png"), tmp_path / "coffee.png")])
    expect(page.locator("#previews img")).to_have_count(1)  # read before it is sent
    assert ask(page, "Describe the image.", 0)[0] not in ("", "…")
    assert ask(page, "What colour is it?", 1)[0] not in ("", "…")
    assert page.locator(".message.user img").count() == 1  # the photo, shown once
    icon = page.request.get(server.url + "/" + page.get_attribute("link[rel=icon]", "href"))
    assert icon.ok and icon.headers["content-type"].startswith("image/svg+xml")
    assert failed == []
    page.close()


def test_cache_label_follows_the_images_not_the_prefix(server, browser, tmp_path):
    page = open_page(browser, server.url)
    ask(page, "How many stars are there?", 0)  # text only: short answers
    page.click("#new-chat")
    _, stats = ask(page, "How many stars are there?", 0)
    assert prefix_hit(stats) > 0 and "image from cache" not in stats  # no image at all
    # A picture never sent before, after the same chat-template prefix: a prefix hit, but
    # the image is encoded.
    page.click("#new-chat")
    scene = scenes.generate_scene(random.Random(12))
    page.set_input_files("#file-input", [save(scene.image, tmp_path / "new.png")])
    expect(page.locator("#previews img")).to_have_count(1)  # read before it is sent
    _, stats = ask(page, "What is in the picture?", 0)
    assert prefix_hit(stats) > 0 and "image from cache: no" in stats
    # The same picture after other text: its embeddings come from the encoder cache.
    page.click("#new-chat")
    ask(page, "How many stars are there?", 0)
    page.set_input_files("#file-input", [save(scene.image, tmp_path / "same.png")])
    expect(page.locator("#previews img")).to_have_count(1)  # read before it is sent
    _, stats = ask(page, "What is in the picture?", 1)
    assert "image from cache: yes" in stats
    page.close()


def test_oversized_upload_shows_a_readable_error(server, browser, tmp_path):
    big = save(Image.new("RGB", (1200, 1000), "blue"), tmp_path / "big.png")  # 1.2 M pixels
    page = open_page(browser, server.url)
    page.set_input_files("#file-input", [big])
    page.fill("#question", "What is this?")
    page.click("#send")
    error = page.locator("#error")
    expect(error).to_contain_text("above the limit", timeout=30_000)
    # The failed turn left the view; its image and question are back in the form.
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#previews img")).to_have_count(1)
    assert page.input_value("#question") == "What is this?"
    assert not page.is_visible("#retry")  # asking again would fail the same way
    # Not an image at all: refused in the page before sending.
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    page.set_input_files("#file-input", [str(text_file)])
    expect(error).to_contain_text("is not an image")
    page.close()


def test_unreachable_and_broken_stream_offer_a_retry_that_works(server, browser):
    page = browser.new_page()
    page.route("**/v1/models", lambda route: route.abort("connectionrefused"))
    page.goto(server.url)
    expect(page.locator("#model-line")).to_contain_text("The server is not reachable")
    page.unroute("**/v1/models")
    page.click("#reconnect")
    expect(page.locator("#model-line")).to_contain_text("Model:")
    expect(page.locator("#reconnect")).to_be_hidden()
    ask(page, "How many stars are there?", 0)
    # The next answer breaks off after one token: no [DONE].
    cut = 'data: {"choices": [{"index": 0, "delta": {"content": "The"}}]}\n\n'
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=cut),
    )
    page.fill("#question", "How many circles are there?")
    page.keyboard.press("Enter")
    expect(page.locator("#error")).to_contain_text("lost before the answer was complete")
    expect(page.locator(".message")).to_have_count(2)  # the first turn only
    assert page.evaluate("state.history.length") == 2
    page.unroute("**/v1/chat/completions")
    page.click("#retry")
    stats = page.locator(".message.assistant .stats").nth(1)
    expect(stats).to_contain_text("TTFT", timeout=60_000)
    expect(page.locator("#error-box")).to_be_hidden()
    assert page.evaluate("state.history.map((m) => m.role)") == ["user", "assistant"] * 2
    page.close()


def test_api_key_and_a_server_stopped_mid_conversation(browser, monkeypatch):
    key = "secret-key"
    ARTIFACTS.mkdir(exist_ok=True)
    first = RemoteServer(str(DEMO_MODEL), ["--api-key", key])
    try:
        page = browser.new_page()
        page.goto(first.url)
        model_line = page.locator("#model-line")
        expect(model_line).to_contain_text("Unauthorized: this server needs an API key")
        expect(page.locator("#api-key")).to_be_visible()
        page.fill("#api-key", "wrong")
        page.click("#key-form button")
        expect(model_line).to_contain_text("did not accept this API key")
        page.fill("#api-key", key)
        page.click("#key-form button")
        expect(model_line).to_contain_text("Model:")
        page.reload()  # the key is kept for the tab
        expect(model_line).to_contain_text("Model:")
        assert page.input_value("#api-key") == key
        ask(page, "How many stars are there?", 0)
        first.stop()
        page.fill("#question", "How many circles are there?")
        page.keyboard.press("Enter")
        expect(page.locator("#error")).to_contain_text("The server is not reachable")
        expect(page.locator(".message")).to_have_count(2)
        expect(page.locator("#retry")).to_be_visible()
        assert page.input_value("#question") == "How many circles are there?"
        page.screenshot(path=str(ARTIFACTS / "web_page_unreachable.png"), full_page=True)
    finally:
        first.stop()
    # The server comes back at the same address: Retry asks the same question.
    monkeypatch.setattr(server_module, "free_port", lambda: first.port)
    with RemoteServer(str(DEMO_MODEL), ["--api-key", key]):
        page.click("#retry")
        stats = page.locator(".message.assistant .stats").nth(1)
        expect(stats).to_contain_text("TTFT", timeout=60_000)
        expect(page.locator(".message")).to_have_count(4)
        assert page.input_value("#question") == ""
    page.close()
