"""The OpenAI-compatible server, driven over HTTP with the official ``openai`` package.

One real ``mm-serve serve`` subprocess (a tiny Qwen2-VL, real photographs) is shared by the
module; the offline ``LLM`` on the same checkpoint is the reference for greedy outputs.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.entrypoints.openai.errors import APIError
from mm_serve.entrypoints.openai.serving_common import Admission
from tests.fixtures.server import free_port, metric, serve_checked
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

API_KEY = "test-key"
MODEL = "tiny-vlm"
MAX_MODEL_LEN = 512
ENGINE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "128"]
MAX_TOKENS = 10


def photo_path(name: str) -> Path:
    """A real photograph shipped inside an installed package."""
    if name == "grace_hopper.jpg":
        import matplotlib

        return Path(matplotlib.get_data_path()) / "sample_data" / name
    import skimage

    return Path(skimage.__file__).parent / "data" / name


def data_url(path: Path) -> str:
    kind = "png" if path.suffix == ".png" else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def png_bytes(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(text: str, *urls: str) -> list[dict]:
    return [{"role": "user", "content": [*map(image_part, urls), {"type": "text", "text": text}]}]


CONVERSATIONS = [
    user("What is in this picture?", data_url(photo_path("grace_hopper.jpg"))),
    user(
        "Compare the two pictures.",
        data_url(photo_path("rocket.jpg")),
        data_url(photo_path("coffee.png")),
    ),
]


class _MediaHandler(http.server.BaseHTTPRequestHandler):
    """Serves a photo, a same-host redirect, an other-host redirect and an oversized file."""

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/photo.jpg":
            self._send(200, photo_path("rocket.jpg").read_bytes())
        elif self.path == "/same-host":
            self._send(302, b"", {"Location": "/photo.jpg"})
        elif self.path == "/other-host":
            self._send(302, b"", {"Location": f"http://localhost:{port}/photo.jpg"})
        elif self.path == "/big.png":
            self._send(200, b"\0" * 3_000_000)
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=5)


@pytest.fixture(scope="module")
def media_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _MediaHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "coffee.png").write_bytes(photo_path("coffee.png").read_bytes())
    return folder


@pytest.fixture(scope="module")
def server(vlm_path, media_server, media_dir):
    args = [
        *ENGINE_FLAGS,
        "--served-model-name", MODEL, "other-name",
        "--api-key", API_KEY,
        "--allowed-media-domains", "127.0.0.1",
        "--allowed-local-media-path", str(media_dir),
        "--limit-mm-per-prompt", '{"image": 3}',
        "--max-media-bytes", "2000000",
        "--max-request-body-bytes", "3000000",
        "--max-pixels", "400000",
        "--max-concurrent-requests", "2",
    ]  # fmt: skip
    yield from serve_checked(vlm_path, args)


@pytest.fixture(scope="module")
def llm(vlm_path):
    llm = LLM(vlm_path, max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, **kwargs)


def token_ids(logprobs_content) -> list[int]:
    return [int(entry.token.removeprefix("token_id:")) for entry in logprobs_content]


def test_chat_matches_offline_llm(client, llm):
    for messages in CONVERSATIONS:
        (ref,) = llm.chat(messages, greedy(), use_tqdm=False)
        expected = ref.outputs[0]
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=MAX_TOKENS,
            logprobs=True,
            top_logprobs=2,
            extra_body={"return_tokens_as_token_ids": True},
        )
        choice = reply.choices[0]
        assert choice.message.content == expected.text
        assert choice.finish_reason == expected.finish_reason
        assert token_ids(choice.logprobs.content) == expected.token_ids
        for entry, ref_step, token in zip(
            choice.logprobs.content, expected.logprobs, expected.token_ids, strict=True
        ):
            assert entry.logprob == pytest.approx(ref_step[token].logprob, abs=1e-4)
            assert len(entry.top_logprobs) == 2
        # Image placeholder tokens count as prompt tokens.
        assert reply.usage.prompt_tokens == len(ref.prompt_token_ids) > 50
        assert reply.usage.completion_tokens == len(expected.token_ids)
        assert reply.model == MODEL


def test_chat_streaming_matches_offline_llm(client, llm):
    messages = CONVERSATIONS[1]
    (ref,) = llm.chat(messages, greedy(), use_tqdm=False)
    stream = client.chat.completions.create(
        model="other-name",
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    pieces = [
        e.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert text == ref.outputs[0].text
    assert pieces == [
        ref.outputs[0].logprobs[i][t].decoded_token for i, t in enumerate(ref.outputs[0].token_ids)
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage.completion_tokens == MAX_TOKENS


def test_stop_strings_and_n(client, llm):
    messages = CONVERSATIONS[0]
    (plain,) = llm.chat(messages, greedy(), use_tqdm=False)
    text = plain.outputs[0].text
    stop = text[len(text) // 2 :][:2]
    (ref,) = llm.chat(messages, greedy(stop=[stop]), use_tqdm=False)
    assert ref.outputs[0].finish_reason == "stop"
    kwargs = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    reply = client.chat.completions.create(**kwargs, stop=[stop], n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:  # greedy: both completions alike
        assert choice.message.content == ref.outputs[0].text
        assert choice.finish_reason == "stop"
    stream = client.chat.completions.create(**kwargs, stop=stop, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Sampled, seeded: n completions differ from each other, and repeat with the seed.
    sampled = {**kwargs, "temperature": 1.0, "n": 2, "seed": 7}
    first = [c.message.content for c in client.chat.completions.create(**sampled).choices]
    again = [c.message.content for c in client.chat.completions.create(**sampled).choices]
    assert first == again and first[0] != first[1]


def test_completions_matches_offline_llm(client, llm):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    refs = llm.generate(prompts, greedy(), use_tqdm=False)
    reply = client.completions.create(
        model=MODEL, prompt=prompts, temperature=0, max_tokens=MAX_TOKENS, logprobs=2
    )
    assert [c.text for c in reply.choices] == [r.outputs[0].text for r in refs]
    assert reply.choices[1].logprobs.tokens == [
        refs[1].outputs[0].logprobs[i][t].decoded_token
        for i, t in enumerate(refs[1].outputs[0].token_ids)
    ]
    assert reply.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    stream = client.completions.create(
        model=MODEL, prompt=prompts[0], temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == refs[0].outputs[0].text


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "other-name"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    before = httpx.get(f"{server.url}/metrics").text
    # Text before a photo seen earlier: a processor-cache hit, but no prefix-cache hit that
    # would cover the image, so the encoder cache is asked.
    image = image_part(data_url(photo_path("grace_hopper.jpg")))
    messages = [{"role": "user", "content": [{"type": "text", "text": "First this."}, image]}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    after = httpx.get(f"{server.url}/metrics").text
    for name in (
        "mm_serve_request_success_total",
        "mm_serve_prompt_tokens_total",
        "mm_serve_time_to_first_token_seconds_count",
        "mm_serve_e2e_request_latency_seconds_count",
        "mm_serve_prefix_cache_queries_total",
        "mm_serve_encoder_cache_queries_total",
        "mm_serve_processor_cache_hits_total",  # the photo was seen before
    ):
        assert metric(after, name) > metric(before, name), name
    assert 'mm_serve_http_requests_total{endpoint="/v1/chat/completions",status="200"}' in after
    assert metric(after, "mm_serve_num_requests_running") == 0
    assert metric(after, "mm_serve_encoder_tokens_computed_total") > 0
    # Profiling is off: no such route (the web page mounted at / answers 405 to a POST).
    assert post(server, "/start_profile", {}).status_code in (404, 405)


def post(server, path: str, body: dict | bytes, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/json"
        return httpx.post(server.url + path, content=body, headers=headers, timeout=30)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def chat_body(messages=None, **fields) -> dict:
    return {"model": MODEL, "messages": messages or user("Hi"), "max_tokens": 2, **fields}


def test_cached_tokens_cache_salt_and_uuid(client):
    block_size = 16

    def uncached_tokens(messages, **extra) -> int:
        """Prompt tokens not found in the prefix cache."""
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body=extra
        )
        return reply.usage.prompt_tokens - reply.usage.prompt_tokens_details.cached_tokens

    messages = user("Once more.", data_url(photo_path("astronaut.png")))
    assert uncached_tokens(messages) > block_size
    assert uncached_tokens(messages) <= block_size  # all but the last partial block hit
    assert uncached_tokens(messages, cache_salt="tenant-a") > block_size  # a salt shares none
    # Two different photos with one uuid are one image to the caches.
    names = ("chelsea.png", "coffee.png")
    first, second = (user("Same id.", data_url(photo_path(name))) for name in names)
    for messages in (first, second):
        messages[0]["content"][0]["uuid"] = "photo-1"
    assert uncached_tokens(first) > block_size
    assert uncached_tokens(second) <= block_size


def test_api_key(server):
    for key in (None, "wrong"):
        response = post(server, "/v1/chat/completions", chat_body(), key=key)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # open, as /metrics


def test_error_statuses(server, media_server, media_dir):
    coffee = data_url(photo_path("coffee.png"))
    big = "data:image/png;base64," + base64.b64encode(png_bytes(700, 700)).decode()
    cases = [
        (chat_body(max_tokens=0), 400, "max_tokens"),
        (chat_body(temperature=-1), 400, "temperature"),
        (chat_body(top_p=0), 400, "top_p"),
        (chat_body(logprobs=True, top_logprobs=30), 400, "logprobs"),
        (chat_body(n="two"), 400, "n"),
        (chat_body(messages=[{"role": "user", "content": [{"type": "video"}]}]), 400, None),
        ({"model": MODEL}, 400, "messages"),
        (chat_body(model="gpt-4"), 404, "model_not_found"),
        (chat_body(user("x", "data:image/png;base64,@@@")), 400, "base64"),
        (chat_body(user("x", "data:image/png;base64,aGVsbG8=")), 400, "image"),
        (chat_body(user("x", coffee, coffee, coffee, coffee)), 400, "At most 3"),
        (chat_body(user("x", big)), 400, "max_pixels"),
        (chat_body(user("x", "/etc/passwd")), 400, "data: URLs"),
        (chat_body(user("x", "file:///etc/passwd")), 400, "outside"),
        (chat_body(user("x", "https://example.com/a.png")), 400, "not allowed"),
        (chat_body(user("x", f"{media_server}/other-host")), 400, "another host"),
        (chat_body(user("x", f"{media_server}/big.png")), 400, "larger than"),
        (chat_body(user("word " * 600)), 400, "maximum length"),
        (chat_body(user("<|vision_start|><|image_pad|><|vision_end|>")), 400, "placeholder"),
        (chat_body(max_tokens=MAX_MODEL_LEN), 400, "context_length_exceeded"),
        (b"{not json", 400, "JSON"),
        (b'{"messages": "' + b"x" * 3_100_000 + b'"}', 413, "request_too_large"),
    ]
    for body, status, needle in cases:
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == status, (needle, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert needle is None or needle in str(error), (needle, error)
    for fields in ({"max_tokens": -1}, {"stop_token_ids": [10**8]}, {"seed": 2**70}):
        bad_completion = post(server, "/v1/completions", {"prompt": "x", **fields})
        assert bad_completion.status_code == 400, bad_completion.text
    # Allowed media: an http URL of an allowed host (through a same-host redirect), a file.
    for url in (f"{media_server}/same-host", (media_dir / "coffee.png").as_uri()):
        response = post(server, "/v1/chat/completions", chat_body(user("x", url)))
        assert response.status_code == 200, response.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_admission_counts_each_requests_sequences() -> None:
    """A request counts its ``n`` against the limit; ``n`` above ``max_n`` is a 400; a request
    alone on the server is admitted whatever its ``n``."""
    admission = Admission(limit=4, max_n=3)
    admission.enter(3)
    with pytest.raises(APIError) as refused:
        admission.enter(2)
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
    admission.enter(1)  # 4 in flight: at the limit
    admission.leave(3)
    admission.leave(1)
    assert admission.in_flight == 0
    with pytest.raises(APIError) as too_many:
        admission.enter(4)
    assert (too_many.value.status, too_many.value.param) == (400, "n")
    alone = Admission(limit=2, max_n=8)
    alone.enter(5)
    assert alone.in_flight == 5


def test_overload(server):
    """Beyond --max-concurrent-requests (2): a 429 with Retry-After; served again afterwards.

    Eight long requests arrive together, so at most two can be in flight at any moment."""
    body = chat_body(user("Go on."), max_tokens=400, ignore_eos=True)
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: post(server, "/v1/chat/completions", body), range(8)))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_overloaded"
    assert post(server, "/v1/chat/completions", chat_body()).status_code == 200
