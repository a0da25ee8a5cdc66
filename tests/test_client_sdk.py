"""The Python SDK ``mm_serve.client`` against a real server subprocess (one per module).

Images go in as a path, bytes, a PIL image and a data URL and must give the same greedy
answer; greedy chat equals the offline ``LLM.chat``; streaming (sync and async) equals the
non-streamed answer; errors come back typed; connection errors are retried exactly
``max_retries`` times and HTTP errors never.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from mm_serve.client import (
    APIConnectionError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    ChatCompletion,
    ChatCompletionChunk,
    Client,
    NotFoundError,
    image_to_url,
)
from tests.fixtures.server import RemoteServer, free_port
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

API_KEY = "sdk-test-key"
MAX_TOKENS = 6
QUESTION = "What is in this picture?"
ABORT = 'finished_reason="abort"'


def photo_path() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("sdk_vlm"), "qwen2_vl", seed=5)


@pytest.fixture(scope="module")
def server(vlm_path):
    lean = ["--num-kv-blocks", "64", "--mm-preprocess-workers", "1"]
    with RemoteServer(vlm_path, ["--api-key", API_KEY, *lean]) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url, api_key=API_KEY, timeout=120) as sdk_client:
        yield sdk_client


@pytest.fixture(scope="module")
def greedy_reply(client) -> ChatCompletion:
    """The greedy answer to QUESTION about the photo, sent as a path."""
    return client.chat(text=QUESTION, images=[photo_path()], temperature=0, max_tokens=MAX_TOKENS)


class CountingTransport(httpx.HTTPTransport):
    """Counts connection attempts (each ``handle_request`` opens or reuses a connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        return super().handle_request(request)


def test_models_and_health(client):
    models = client.models()
    assert models and models[0].id
    assert client.default_model() == models[0].id
    assert client.health() is True


def test_image_kinds_give_the_same_greedy_answer(client, greedy_reply):
    """A path (JPEG), its bytes, the decoded PIL image (sent as PNG: same pixels) and a data
    URL all reach the model as the same pixels."""
    assert greedy_reply.choices[0].finish_reason in ("stop", "length")
    assert greedy_reply.usage.completion_tokens >= 1
    jpeg = photo_path().read_bytes()
    data_url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    for image in (jpeg, Image.open(io.BytesIO(jpeg)), data_url, str(photo_path())):
        reply = client.chat(text=QUESTION, images=[image], temperature=0, max_tokens=MAX_TOKENS)
        assert reply.choices[0].message.content == greedy_reply.choices[0].message.content
        assert reply.usage.prompt_tokens == greedy_reply.usage.prompt_tokens


def test_greedy_equals_offline_llm(client, vlm_path):
    from mm_serve import LLM, SamplingParams

    messages = [
        {"role": "system", "content": "You describe photographs."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": image_to_url(photo_path())}},
                {"type": "text", "text": "Who is this?"},
            ],
        },
    ]
    reply = client.chat(messages, temperature=0, max_tokens=8)
    llm = LLM(vlm_path)
    try:
        offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    finally:
        llm.shutdown()
    expected = offline[0].outputs[0]
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens == len(offline[0].prompt_token_ids)


def test_streaming_equals_non_streaming(client, greedy_reply):
    stream = client.chat(
        text=QUESTION,
        images=[photo_path()],
        stream=True,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream_options={"include_usage": True},
    )
    with stream:
        chunks = list(stream)
    assert all(isinstance(chunk, ChatCompletionChunk) for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_reply.choices[0].message.content
    assert len(chunks) >= 2  # separate events: the text, then the usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    usage, expected = chunks[-1].usage, greedy_reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        expected.prompt_tokens,
        expected.completion_tokens,
        expected.total_tokens,
    )


def metric(client: Client, name_part: str, label: str = "", default: float | None = None):
    """The first ``/metrics`` sample whose name contains ``name_part`` (and ``label``), else
    ``default`` (a labelled counter appears with its first count)."""
    for line in client.metrics().splitlines():
        name, _, value = line.rpartition(" ")
        if not line.startswith("#") and name_part in name and label in name:
            return float(value)
    assert default is not None, f"/metrics has no {name_part}{label}"
    return default


def test_stream_closed_early_aborts_the_request(client, greedy_reply):
    """Closing a stream drops the connection: the server aborts the request (counted with
    finish_reason "abort") and frees its KV blocks."""
    aborted = metric(client, "request_success_total", ABORT, 0.0)
    params = dict(stream=True, max_tokens=800, ignore_eos=True)
    stream = client.chat(text=QUESTION, images=[photo_path()], **params)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        metric(client, "request_success_total", ABORT, 0.0) == aborted
        or metric(client, "kv_cache_usage") > 0
    ):
        time.sleep(0.1)
    assert metric(client, "request_success_total", ABORT, 0.0) == aborted + 1
    assert metric(client, "kv_cache_usage") == 0.0
    reply = client.chat(text=QUESTION, images=[photo_path()], temperature=0, max_tokens=MAX_TOKENS)
    assert reply.choices[0].message.content == greedy_reply.choices[0].message.content


def test_completions(client):
    whole = client.completions("Once upon a time", temperature=0, max_tokens=5)
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.total_tokens
    with client.completions("Once upon a time", temperature=0, max_tokens=5, stream=True) as s:
        streamed = "".join(chunk.choices[0].text for chunk in s if chunk.choices)
    assert streamed == whole.choices[0].text


def test_n2_and_logprobs(client):
    params = dict(n=2, temperature=1.0, seed=1, max_tokens=4, logprobs=True, top_logprobs=2)
    reply = client.chat(text="Say something.", **params)
    assert sorted(choice.index for choice in reply.choices) == [0, 1]
    for choice in reply.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 4
        assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in content)
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)


def test_typed_errors(server, client):
    with Client(server.url) as anonymous, pytest.raises(AuthenticationError) as info:
        anonymous.chat(text="hi", model="any", max_tokens=2)
    assert info.value.status_code == 401 and info.value.message
    with Client(server.url, api_key="wrong") as wrong, pytest.raises(AuthenticationError):
        wrong.models()
    with pytest.raises(NotFoundError) as info:
        client.chat(text="hi", model="no-such-model", max_tokens=2)
    assert info.value.status_code == 404 and "no-such-model" in info.value.message
    with pytest.raises(BadRequestError) as info:
        client.chat(text="hi", images=[b"definitely not an image"], max_tokens=2)
    assert info.value.status_code == 400 and info.value.message
    with pytest.raises(BadRequestError):  # raised by chat(), before any chunk
        client.chat(text="hi", images=[b"not an image either"], stream=True, max_tokens=2)
    with pytest.raises(BadRequestError) as info:
        client.chat(text="hi", max_tokens=0)
    assert "max_tokens" in info.value.message
    with pytest.raises(BadRequestError) as info:  # a wrong type: 400 naming it, as OpenAI
        client.chat(text="hi", max_tokens="many")
    assert info.value.status_code == 400 and info.value.param == "max_tokens"


def test_http_errors_are_not_retried(server):
    transport = CountingTransport()
    http = httpx.Client(transport=transport)
    sdk = Client(server.url, api_key=API_KEY, max_retries=3, http_client=http)
    with http, pytest.raises(NotFoundError):
        sdk.chat(text="hi", model="no-such-model", max_tokens=2)
    assert transport.attempts == 1


@pytest.mark.parametrize("max_retries", [0, 2])
def test_connection_error_after_exactly_max_retries(max_retries):
    transport = CountingTransport()
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    with httpx.Client(transport=transport) as http:
        sdk = Client(url, max_retries=max_retries, http_client=http)
        with pytest.raises(APIConnectionError):
            sdk.chat(text="hi", model="m", max_tokens=2)
    assert transport.attempts == max_retries + 1


def test_async_connection_error_after_exactly_max_retries():
    class AsyncCountingTransport(httpx.AsyncHTTPTransport):
        attempts = 0

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            self.attempts += 1
            return await super().handle_async_request(request)

    async def run(transport: AsyncCountingTransport) -> None:
        async with httpx.AsyncClient(transport=transport) as http:
            sdk = AsyncClient(f"http://127.0.0.1:{free_port()}", max_retries=1, http_client=http)
            with pytest.raises(APIConnectionError):
                await sdk.chat(text="hi", model="m", max_tokens=2, stream=True)

    transport = AsyncCountingTransport()
    asyncio.run(run(transport))
    assert transport.attempts == 2


def test_local_argument_errors():
    sdk = Client("http://127.0.0.1:9", max_retries=0)
    with pytest.raises(ValueError):
        sdk.chat(model="m")  # neither messages nor text/images
    with pytest.raises(ValueError):
        sdk.chat([{"role": "user", "content": "hi"}], text="hi", model="m")
    with pytest.raises(TypeError):
        sdk.chat(text="hi", images=[object()], model="m")
    with pytest.raises(FileNotFoundError):
        sdk.chat(text="hi", images=[Path("/no/such/image.png")], model="m")
    sdk.close()


def test_async_client_streaming(server, greedy_reply):
    async def run() -> tuple[str, str]:
        async with AsyncClient(server.url, api_key=API_KEY, timeout=120) as sdk:
            stream = await sdk.chat(
                text=QUESTION,
                images=[photo_path().read_bytes()],
                stream=True,
                temperature=0,
                max_tokens=MAX_TOKENS,
            )
            async with stream:
                parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            reply = await sdk.chat(
                text=QUESTION, images=[photo_path()], temperature=0, max_tokens=MAX_TOKENS
            )
            with pytest.raises(NotFoundError):
                await sdk.chat(text="hi", model="no-such-model", max_tokens=2, stream=True)
            return "".join(parts), reply.choices[0].message.content

    streamed, whole = asyncio.run(run())
    assert streamed == whole == greedy_reply.choices[0].message.content
