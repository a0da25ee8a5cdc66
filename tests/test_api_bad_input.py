"""Malformed requests against a real server: each gets its documented 4xx status and an
OpenAI-style error JSON with a clear message, and afterwards the server still serves and
holds no KV blocks.

Statuses (the API contract, OpenAI's): 400 for a body that is not JSON or does not match the
schema (a wrong type, a missing field: ``param`` names it) and for an invalid value (bad image,
bad base64, too many images, prompt beyond the context, out-of-range sampling parameter,
disallowed URL), 404 for an unknown model, 413 for a body above ``--max-request-body-bytes``.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.fixtures.server import RemoteServer
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

MAX_MODEL_LEN = 256
LIMIT_IMAGES = 2
MAX_PIXELS = 2_000_000
MAX_PIXELS_PER_REQUEST = 3_000_000
MAX_BODY_BYTES = 1_000_000
ALLOWED_DOMAIN = "images.allowed.test"
SERVED = "<served model>"  # replaced by the server's model id when sent
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOKENIZE = "/tokenize"
INTERNALS = ("Traceback", 'File "', "site-packages", "mm_serve/")


def photo_bytes() -> bytes:
    import matplotlib

    return (Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg").read_bytes()


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A few dozen bytes of PNG whose header declares ``width`` x ``height`` RGB pixels: a
    decompression bomb if the server decodes before checking the size."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


SMALL_PNG = png_bytes(Image.new("RGB", (64, 48), (200, 30, 30)))


def chat(content: Any = "Hello!", **params: Any) -> dict[str, Any]:
    """A chat body with one user message; ``params`` override the defaults."""
    body = {"model": SERVED, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    body.update(params)
    return body


def with_image(url: str, text: str = "What is this?") -> list[dict[str, Any]]:
    return [image(url), {"type": "text", "text": text}]


@dataclass
class Bad:
    """One malformed request: ``body`` (a dict sent as JSON, raw bytes, or a function of the
    local media root returning a dict), ``phrases`` ("a|b": the error message must contain one
    of them, case-insensitive) and the statuses the contract allows."""

    name: str
    body: dict[str, Any] | bytes | Callable[[Path], dict[str, Any]]
    phrases: str
    statuses: tuple[int, ...] = (400,)
    path: str = CHAT
    param: str | None = None  # the error's ``param``, where the case pins it


PIXELS = "pixel|large|exceed"
CONTEXT = "context|max_model_len|too long|maximum"
DISALLOWED = "allowed|domain|not permitted"
OUTSIDE = "allowed|outside|not permitted"
_photo = photo_bytes()
_png = data_url(SMALL_PNG)
CASES = [
    # --- not JSON / not the schema ---
    Bad("invalid_json", b'{"model": "x", "messages": [', "json"),
    Bad("empty_body", b"", "json|body|field required|missing"),
    Bad("json_array_body", b"[1, 2]", "object|dict|valid"),
    Bad("missing_messages", {"model": SERVED, "max_tokens": 2}, "messages"),
    Bad("messages_not_a_list", chat() | {"messages": "hi"}, "messages"),
    Bad("message_without_role", chat() | {"messages": [{"content": "hi"}]}, "role"),
    Bad("content_is_a_number", chat(5), "content"),
    Bad("max_tokens_not_int", chat(max_tokens="ten"), "max_tokens"),
    Bad("max_tokens_is_bool", chat(max_tokens=True), "integer", param="max_tokens"),
    Bad("max_tokens_numeric_string", chat(max_tokens="10"), "integer", param="max_tokens"),
    Bad("stream_is_a_string", chat(stream="yes"), "bool", param="stream"),
    Bad(
        "user_content_null",
        chat() | {"messages": [{"role": "user", "content": None}]},
        "content is required",
        param="messages[0]",
    ),
    Bad("lone_surrogate", chat("\ud800 hi"), "unicode", param="messages[0].content"),
    Bad(
        "lone_surrogate_in_a_part",
        chat([{"type": "text", "text": "a\udfffb"}]),
        "unicode",
        param="messages[0].content[0].text",
    ),
    Bad(
        "completions_lone_surrogate",
        {"prompt": "\ud800"},
        "unicode",
        path=COMPLETIONS,
        param="prompt",
    ),
    Bad("tokenize_lone_surrogate", {"prompt": "\ud800"}, "unicode", path=TOKENIZE, param="prompt"),
    Bad("temperature_not_number", chat(temperature="hot"), "temperature"),
    Bad("n_is_fractional", chat(n=1.5), "integer"),
    Bad("stream_is_a_list", chat(stream=[1]), "stream"),
    Bad("stop_is_a_number", chat(stop=7), "stop"),
    Bad("image_url_not_a_string", chat([image(5)]), "url"),
    Bad("uuid_not_a_string", chat([image(_png) | {"uuid": 7}]), "uuid"),
    Bad("cache_salt_not_a_string", chat(cache_salt=5), "cache_salt"),
    Bad("image_url_without_url", chat([{"type": "image_url", "image_url": {}}]), "url"),
    Bad("unsupported_part_type", chat([{"type": "video_url"}]), "video_url|type"),
    Bad("empty_messages", chat() | {"messages": []}, "messages|empty"),
    # --- bad images ---
    Bad("bad_base64", chat(with_image("data:image/png;base64,!!not*base64@@")), "base64"),
    Bad("truncated_png", chat(with_image(_png[: len(_png) // 2])), "image|truncated"),
    Bad(
        "truncated_jpeg",
        chat(with_image(data_url(_photo[: len(_photo) // 3], "image/jpeg"))),
        "image|truncated",
    ),
    Bad("not_an_image", chat(with_image(data_url(b"hello, world! " * 20))), "image"),
    Bad("empty_image", chat(with_image("data:image/png;base64,")), "image|empty"),
    Bad("decompression_bomb", chat(with_image(data_url(png_declaring(30000, 30000)))), PIXELS),
    Bad(
        "bomb_named_as_our_limit",
        chat(with_image(data_url(png_declaring(20000, 20000)))),
        "max_pixels",
    ),
    Bad(
        "png_as_text_plain",
        chat(with_image(data_url(SMALL_PNG, "text/plain"))),
        "media type",
    ),
    Bad("header_above_max_pixels", chat(with_image(data_url(png_declaring(4000, 4000)))), PIXELS),
    Bad(
        "image_above_max_pixels",
        chat(with_image(data_url(png_bytes(Image.new("RGB", (1500, 1500)))))),
        PIXELS,
    ),
    Bad(
        "images_above_max_pixels_per_request",
        chat([image(data_url(png_declaring(1600, 1000)))] * LIMIT_IMAGES),
        "max_pixels_per_request",
        param="messages",
    ),
    Bad("zero_by_zero_image", chat(with_image(data_url(png_declaring(0, 0)))), "image"),
    Bad("too_many_images", chat([image(_png)] * (LIMIT_IMAGES + 1)), "at most|limit|too many"),
    Bad("stream_with_bad_image", chat(with_image(_png[:30] + "%%%"), stream=True), "base64"),
    # --- values out of range ---
    Bad("prompt_beyond_context", chat("hello " * (3 * MAX_MODEL_LEN)), CONTEXT),
    Bad("max_tokens_beyond_context", chat(max_tokens=10 * MAX_MODEL_LEN), CONTEXT),
    Bad("max_tokens_zero", chat(max_tokens=0), "max_tokens"),
    Bad("max_tokens_negative", chat(max_tokens=-5), "max_tokens"),
    Bad("max_completion_tokens_zero", chat(max_completion_tokens=0), "max_tokens|max_completion"),
    Bad("temperature_negative", chat(temperature=-0.5), "temperature"),
    Bad("top_p_above_one", chat(top_p=1.5), "top_p"),
    Bad("top_p_zero", chat(top_p=0.0), "top_p"),
    Bad("top_k_below_minus_one", chat(top_k=-2), "top_k"),
    Bad("min_p_above_one", chat(min_p=2.0), "min_p"),
    Bad("presence_penalty_too_big", chat(presence_penalty=5.0), "presence_penalty"),
    Bad("frequency_penalty_too_small", chat(frequency_penalty=-3.0), "frequency_penalty"),
    Bad("repetition_penalty_zero", chat(repetition_penalty=0.0), "repetition_penalty"),
    Bad("n_zero", chat(n=0), "n must|'n'|`n`"),
    Bad("n_above_the_limit", chat(n=129), "at most 128", param="n"),
    Bad("top_logprobs_negative", chat(logprobs=True, top_logprobs=-1), "logprobs"),
    Bad(
        "top_logprobs_above_20",
        chat(logprobs=True, top_logprobs=50),
        "top_logprobs",
        param="top_logprobs",
    ),
    Bad("unsupported_field", chat(tool_choice="auto"), "tool_choice"),
    Bad(
        "unsupported_message_field",
        chat() | {"messages": [{"role": "user", "content": "Hi", "audio": {"id": "a1"}}]},
        "messages[0].audio",
    ),
    Bad("unsupported_vllm_field", chat(thinking_token_budget=8), "thinking_token_budget"),
    Bad(
        "response_format_without_schema",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "response_format",
    ),
    Bad("logit_bias_beyond_vocab", chat(logit_bias={"100000000": 1}), "logit_bias"),
    Bad("beam_search_with_stop", chat(use_beam_search=True, stop=["x"]), "stop"),
    Bad(
        "beam_search_with_a_grammar",
        chat(use_beam_search=True, structured_outputs={"regex": "a"}),
        "structured_outputs",
    ),
    Bad("structured_outputs_empty_choice", chat(structured_outputs={"choice": []}), "choice"),
    Bad("temperature_above_two", chat(temperature=2.5), "temperature"),
    Bad(
        "completions_chat_template_option",
        {"prompt": "hi", "echo": True, "continue_final_message": True},
        "continue_final_message",
        path=COMPLETIONS,
    ),
    Bad("chat_suffix", chat(suffix="!"), "suffix"),
    Bad("continue_final_message", chat(continue_final_message=True), "continue_final_message"),
    # --- model and media locations ---
    Bad("unknown_model", chat() | {"model": "no-such-model"}, "no-such-model", (404,)),
    Bad("http_host_not_allowed", chat(with_image("http://example.com/cat.png")), DISALLOWED),
    Bad("http_loopback_not_allowed", chat(with_image("http://127.0.0.1:1/a.png")), DISALLOWED),
    Bad("unsupported_url_scheme", chat(with_image("ftp://example.com/a.png")), "scheme|url"),
    Bad("file_outside_root", chat(with_image("file:///etc/passwd")), OUTSIDE),
    Bad(
        "file_dotdot_escape",
        lambda root: chat(with_image(f"file://{root}/../outside/secret.png")),
        OUTSIDE,
    ),
    Bad(
        "file_missing_inside_root",
        lambda root: chat(with_image(f"file://{root}/missing.png")),
        "not found|no such|does not exist|missing",
    ),
    # --- the completions endpoint ---
    Bad("completions_beyond_context", {"prompt": "hi " * 1000}, CONTEXT, path=COMPLETIONS),
    Bad(
        "completions_max_tokens_zero",
        {"prompt": "hi", "max_tokens": 0},
        "max_tokens",
        path=COMPLETIONS,
    ),
    Bad("completions_missing_prompt", {"max_tokens": 2}, "prompt", path=COMPLETIONS),
    # --- size ---
    Bad("body_too_large", chat("a" * (MAX_BODY_BYTES + 1000)), "large|limit|exceed", (413,)),
]


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("media")
    (base / "root").mkdir()
    (base / "outside").mkdir()
    (base / "root" / "ok.png").write_bytes(SMALL_PNG)
    (base / "outside" / "secret.png").write_bytes(SMALL_PNG)
    return base / "root"


@pytest.fixture(scope="module")
def server(tmp_path_factory, media_root):
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("bad_vlm"), "qwen2_vl", seed=6)
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--limit-mm-per-prompt", str(LIMIT_IMAGES)]
    args += ["--max-pixels", str(MAX_PIXELS), "--max-request-body-bytes", str(MAX_BODY_BYTES)]
    args += ["--max-pixels-per-request", str(MAX_PIXELS_PER_REQUEST)]
    args += ["--allowed-media-domains", ALLOWED_DOMAIN]
    args += ["--allowed-local-media-path", str(media_root)]
    args += ["--num-kv-blocks", "64", "--mm-preprocess-workers", "1"]
    log_path = tmp_path_factory.mktemp("bad_vlm_log") / "server.log"
    with log_path.open("w") as log, RemoteServer(path, args, stderr=log) as remote:
        remote.log_path = log_path
        yield remote


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def send(http: httpx.Client, path: str, body: Any, model_id: str, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
        return http.post(path, content=body, headers=headers, **kwargs)
    if body.get("model", SERVED) == SERVED:  # the served model unless the case names one
        body = {**body, "model": model_id}
    # json.dumps escapes non-ASCII (a lone surrogate becomes "\\ud800", valid JSON text).
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return http.post(path, content=json.dumps(body).encode(), headers=headers, **kwargs)


def assert_error(response: httpx.Response, statuses: tuple[int, ...], phrases: str):
    """The documented status, OpenAI-style error JSON, a clear message, no internals."""
    assert response.status_code in statuses, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code", "param"}, error
    message = error["message"]
    assert isinstance(message, str) and message.strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    assert not any(leak in message for leak in INTERNALS), message
    lowered = message.lower()
    assert any(p.lower() in lowered for p in phrases.split("|")), (phrases, message)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_request(http, model_id, media_root, case: Bad):
    body = case.body(media_root) if callable(case.body) else case.body
    response = send(http, case.path, body, model_id)
    assert_error(response, case.statuses, case.phrases)
    if case.param is not None:
        assert response.json()["error"]["param"] == case.param


def test_body_too_large_without_content_length(http, model_id):
    """A chunked body (no Content-Length) above the limit is cut off with 413 too."""
    payload = b'{"model": "%s", "messages": [{"role": "user", "content": "' % model_id.encode()
    filler = b"a" * 65536

    def chunks():
        yield payload
        for _ in range(MAX_BODY_BYTES // len(filler) + 2):
            yield filler
        yield b'"}], "max_tokens": 2}'

    response = http.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(response, (413,), "large|limit|exceed")


def test_unknown_path_is_404(http):
    assert_error(http.get("/v1/no-such-endpoint"), (404,), "not found")


def test_wrong_method_is_405(http):
    """The server's error table (entrypoints/openai/errors.py): a known path, another method."""
    assert_error(http.get(CHAT), (405,), "method")


def test_fields_neither_openai_nor_vllm_define_are_accepted_and_logged_once(server, http, model_id):
    """As vLLM: a field of neither API, at the top level, in a message, a content part or its
    image_url, or another object (``response_format``), is served and its name logged once
    (per field, whatever the index)."""
    parts = [
        {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}},
        {"type": "image_url", "image_url": {"url": data_url(SMALL_PNG), "resize": 2}},
    ]
    body = chat(parts, no_such_field={"x": 1}, response_format={"type": "text", "strictness": 1})
    body["messages"][0]["no_such_key"] = 1
    for _ in range(2):
        response = send(http, CHAT, body, model_id)
        assert response.status_code == 200, response.text
    log = server.log_path.read_text()
    for field in (
        "no_such_field",
        "messages[].no_such_key",
        "messages[].content[].cache_control",
        "messages[].content[].image_url.resize",
        "response_format.strictness",
    ):
        assert log.count(f"Ignoring the field {field!r}") == 1, (field, log[-3000:])


def test_tiny_image_is_served_or_rejected_cleanly(http, model_id):
    """A 1x1 image is legal input: served, or refused with a 400 that says why, never 5xx."""
    body = chat(with_image(data_url(png_bytes(Image.new("RGB", (1, 1))))))
    response = send(http, CHAT, body, model_id)
    if response.status_code != 200:
        assert_error(response, (400,), "image|small|size|pixel")


def gauges(http: httpx.Client) -> dict[str, float]:
    """The unlabelled samples of ``/metrics`` (Prometheus text), by metric name."""
    values = {}
    for line in http.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            values[name] = float(value)
    return values


def held(http: httpx.Client) -> dict[str, float]:
    """What the engine still holds: KV and encoder-cache usage (fractions) and requests."""
    values = gauges(http)
    parts = ("kv_cache_usage", "encoder_cache_usage", "num_requests_running")
    found = {part: [v for name, v in values.items() if part in name] for part in parts}
    assert all(found.values()), f"/metrics lacks one of {parts}: {sorted(values)}"
    return {part: max(vs) for part, vs in found.items()}


def test_still_serving_and_nothing_held_afterwards(http, model_id, media_root):
    """Runs after the bad requests (pytest keeps file order): valid requests, including an
    allowed local file, still succeed, and then every KV block is free again, no encoder-cache
    entry is referenced and no request runs."""
    for content in (
        "Hello!",
        with_image(data_url(_photo, "image/jpeg")),
        with_image(f"file://{media_root}/ok.png"),
    ):
        response = send(http, CHAT, chat(content, max_tokens=3), model_id)
        assert response.status_code == 200, response.text[:500]
        reply = response.json()
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200
    deadline = time.monotonic() + 10
    while any((now := held(http)).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(now.values()), now
