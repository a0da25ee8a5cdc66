"""LoRA adapters through the OpenAI server (vLLM's ``--lora-modules`` and runtime loading).

One real ``mm-serve serve`` on a tiny Qwen2-VL with two ``peft`` adapters given by
``--lora-modules`` (rank 8 as ``name=path``; rank 64, also on the vision tower and projector, in
vLLM's JSON form), started with
``MM_SERVE_ALLOW_RUNTIME_LORA_UPDATING=true``; the offline ``LLM`` with the same adapters is the
reference for greedy tokens. The shared ``vlm_server`` (started without the variable) shows the
runtime routes absent.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mm_serve import LLM, LoRARequest, SamplingParams
from mm_serve.entrypoints.cli import build_parser, server_config_from
from mm_serve.entrypoints.openai.serving_models import LoRAModulePath
from tests.fixtures.images import photo
from tests.fixtures.lora_adapters import build_lora_adapters
from tests.fixtures.server import assert_group_gone, image_question, serve_checked
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

MODEL = "tiny-vlm"
MAX_TOKENS = 8
LIMITS = {"max_loras": 2, "max_lora_rank": 64, "max_model_len": 512, "num_kv_blocks": 64}
ENGINE = ["--enable-lora", *(f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items())]
PROMPTS = ["A text-only question about nothing in particular.", "Count to five:"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """(base path, {adapter name: folder}): ranks 8, 16 and 64 (``lora_adapters``)."""
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=3)
    return path, build_lora_adapters(path, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def server(checkpoint):
    """The server, ``qv`` (rank 8) and ``tower`` (rank 64, parent "base-of-tower") served,
    runtime updating on; the variable is set only while it starts (``vlm_server`` must not see
    it)."""
    path, adapters = checkpoint
    tower = {"name": "tower", "path": adapters["tower-r64"], "base_model_name": "base-of-tower"}
    modules = ["--lora-modules", f"qv={adapters['qv-r8']}", json.dumps(tower)]
    servers = serve_checked(path, [*ENGINE, *modules, "--served-model-name", MODEL])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MM_SERVE_ALLOW_RUNTIME_LORA_UPDATING", "true")
        remote = next(servers)
    yield remote
    with contextlib.suppress(StopIteration):
        next(servers)  # serve_checked's exit checks


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def offline(checkpoint):
    """(engine, {served name: LoRARequest or None}) as the server serves them, and ``lm`` (rank
    16) which the tests load at run time."""
    path, adapters = checkpoint
    llm = LLM(path, enable_lora=True, **LIMITS)
    loras = {
        MODEL: None,
        "qv": LoRARequest("qv", 1, adapters["qv-r8"]),
        "tower": LoRARequest("tower", 2, adapters["tower-r64"]),
        "lm": LoRARequest("lm", 3, adapters["lm-r16"]),
    }
    yield llm, loras
    llm.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def offline_tokens(offline, name: str) -> list[list[int]]:
    """The offline greedy tokens of each of ``PROMPTS`` with the adapter served as ``name``."""
    llm, loras = offline
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras[name])
    return [list(o.outputs[0].token_ids) for o in outputs]


def completion(http: httpx.Client, model: str, prompt: str) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = http.post("/v1/completions", json=body | {"return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def chat(http: httpx.Client, model: str, messages: list[dict]) -> list[int]:
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = http.post("/v1/chat/completions", json=body | {"return_token_ids": True})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response.json()["choices"][0]["token_ids"]


def assert_error(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"], response.text


def test_models_lists_the_adapters(http, checkpoint):
    path, adapters = checkpoint
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert list(cards) == [MODEL, "qv", "tower"]
    assert cards[MODEL]["root"] == path and cards[MODEL]["parent"] is None
    assert (cards["qv"]["root"], cards["qv"]["parent"]) == (adapters["qv-r8"], MODEL)
    tower = (adapters["tower-r64"], "base-of-tower")
    assert (cards["tower"]["root"], cards["tower"]["parent"]) == tower
    card = http.get("/v1/models/tower").json()
    assert (card["id"], card["root"], card["parent"]) == ("tower", *tower)
    assert_error(http.get("/v1/models/nope"), 404, "nope")


def test_adapters_and_base_in_one_batch_equal_offline(http, offline):
    """Completions and image chats of the base model and both adapters, all at once: each
    request's greedy tokens are the offline engine's with the same adapter (the tower
    adapter's image chat: its vision tower and projector too)."""
    names = [MODEL, "qv", "tower"]
    messages = image_question(photo_url(), "Describe the image.")
    with ThreadPoolExecutor(len(names) * (len(PROMPTS) + 1)) as pool:
        texts = {n: [pool.submit(completion, http, n, p) for p in PROMPTS] for n in names}
        images = {n: pool.submit(chat, http, n, messages) for n in names}
        served = {n: [f.result() for f in texts[n]] for n in names}
        served_chat = {n: f.result() for n, f in images.items()}
    llm, loras = offline
    for name in names:
        assert served[name] == offline_tokens(offline, name), name
        reply = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=loras[name])
        assert served_chat[name] == list(reply[0].outputs[0].token_ids), name
    assert len({tuple(served[n][0]) for n in names}) == 3  # each adapter changes the output
    assert len({tuple(served_chat[n]) for n in names}) == 3


def photo_url() -> str:
    from mm_serve.client.images import image_to_url

    return image_to_url(photo("grace_hopper.jpg"))


def test_streamed_completion_and_response_with_an_adapter(http, offline):
    """A streamed completion's tokens and a Responses API reply's text by an adapter's name
    are the offline engine's with that adapter."""
    body = {"model": "qv", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"stream": True, "return_token_ids": True}
    tokens = []
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0]["token_ids"] or []
    assert tokens == offline_tokens(offline, "qv")[0]
    body = {"model": "qv", "input": PROMPTS[0], "max_output_tokens": MAX_TOKENS, "temperature": 0}
    reply = http.post("/v1/responses", json=body)
    assert reply.status_code == 200 and reply.json()["model"] == "qv", reply.text
    llm, loras = offline
    messages = [{"role": "user", "content": PROMPTS[0]}]
    (expected,) = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=loras["qv"])
    assert reply.json()["output"][0]["content"][0]["text"] == expected.outputs[0].text


def test_unknown_model_is_404(http):
    for path, body in (
        ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
        ("/v1/responses", {"input": "a", "max_output_tokens": 2}),
    ):
        response = http.post(path, json=body | {"model": "no-such-adapter"})
        assert_error(response, 404, "no-such-adapter")
        assert response.json()["error"]["code"] == "model_not_found"


def test_runtime_load_and_unload(http, checkpoint, offline):
    _, adapters = checkpoint
    load = {"lora_name": "lm2", "lora_path": adapters["lm-r16"]}
    response = http.post("/v1/load_lora_adapter", json=load)
    assert response.status_code == 200 and "lm2" in response.text
    assert "lm2" in [card["id"] for card in http.get("/v1/models").json()["data"]]
    assert [completion(http, "lm2", p) for p in PROMPTS] == offline_tokens(offline, "lm")
    assert_error(http.post("/v1/load_lora_adapter", json=load), 400, "already been loaded")
    taken = {"lora_name": MODEL, "lora_path": adapters["qv-r8"]}
    assert_error(http.post("/v1/load_lora_adapter", json=taken), 400, "base model's name")
    empty = {"lora_name": "x", "lora_path": ""}
    assert_error(http.post("/v1/load_lora_adapter", json=empty), 400, "must be provided")
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "lm2"})
    assert response.status_code == 200 and "removed" in response.text
    assert_error(http.post("/v1/completions", json={"model": "lm2", "prompt": "a"}), 404, "lm2")
    unload = http.post("/v1/unload_lora_adapter", json={"lora_name": "lm2"})
    assert_error(unload, 404, "cannot be found")
    assert [completion(http, "qv", p) for p in PROMPTS] == offline_tokens(offline, "qv")


def test_bad_adapter_is_400_and_nothing_is_loaded(http, checkpoint, offline, tmp_path):
    _, adapters = checkpoint
    unreadable = shutil.copytree(adapters["qv-r8"], tmp_path / "unreadable")
    (unreadable / "adapter_config.json").write_text("{not json")
    big = shutil.copytree(adapters["qv-r8"], tmp_path / "big")
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps(config | {"r": 128}))
    cases = {
        "big": (str(big), "above max_lora_rank=64"),
        "missing": (str(tmp_path / "nowhere"), "Cannot read"),
        "unreadable": (str(unreadable), "adapter_config.json"),
    }
    models = http.get("/v1/models").json()["data"]
    for name, (folder, words) in cases.items():
        body = {"lora_name": name, "lora_path": folder}
        assert_error(http.post("/v1/load_lora_adapter", json=body), 400, words)
        assert http.get("/v1/models").json()["data"] == models
        assert_error(http.post("/v1/completions", json={"model": name, "prompt": "a"}), 404, name)
    # The names are free: a good adapter loads under one, and the server serves as before.
    good = {"lora_name": "big", "lora_path": adapters["lm-r16"]}
    assert http.post("/v1/load_lora_adapter", json=good).status_code == 200
    assert [completion(http, "big", p) for p in PROMPTS] == offline_tokens(offline, "lm")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "big"}).status_code == 200
    assert [completion(http, MODEL, p) for p in PROMPTS] == offline_tokens(offline, MODEL)


def test_runtime_routes_need_the_variable(vlm_server):
    """Without ``MM_SERVE_ALLOW_RUNTIME_LORA_UPDATING`` the routes are not there (vLLM's)."""
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        response = httpx.post(f"{vlm_server.url}{path}", json={"lora_name": "a", "lora_path": "b"})
        assert response.status_code == 404, response.text


@pytest.mark.parametrize(
    "text, module",
    [
        ("a=/x/y", LoRAModulePath("a", "/x/y")),
        ('{"name": "a", "path": "/x"}', LoRAModulePath("a", "/x")),
        ('{"name": "a", "path": "/x", "base_model_name": "b"}', LoRAModulePath("a", "/x", "b")),
    ],
)
def test_lora_module_forms(text, module):
    argv = ["serve", "m", "--enable-lora", "--lora-modules", text]
    assert server_config_from(build_parser(argv).parse_args(argv)).lora_modules == (module,)


@pytest.mark.parametrize("text", ["a", "=/x", "a=", '{"name": "a"}', '{"name": "a", "p": 1}'])
def test_bad_lora_module_is_refused(text):
    with pytest.raises(ValueError):
        LoRAModulePath.parse(text)


def test_bad_lora_module_stops_the_server(checkpoint):
    """A ``--lora-modules`` adapter that cannot be served: exit 1 naming it, no process left."""
    path, adapters = checkpoint
    command = [sys.executable, "-m", "mm_serve.entrypoints.launch", "serve", path, "--port", "0"]
    command += ["--enable-lora", "--max-lora-rank", "16", "--lora-modules"]
    command += [f"qv={adapters['qv-r8']}", f"big={adapters['tower-r64']}"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.wait(120) == 1
    log = proc.stderr.read().decode()
    assert "--lora-modules big: The adapter's rank 64 is above max_lora_rank=16" in log, log
    assert_group_gone(proc.pid)


def test_lora_modules_need_enable_lora():
    argv = ["serve", "m", "--lora-modules", "a=/x"]
    with pytest.raises(ValueError, match="--enable-lora"):
        server_config_from(build_parser(argv).parse_args(argv))


def test_runtime_loading_needs_one_api_server(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    argv = ["serve", "m", "--enable-lora", "--api-server-count", "2"]
    with pytest.raises(ValueError, match="needs one API server"):
        server_config_from(build_parser(argv).parse_args(argv))
    argv[-1] = "1"
    assert server_config_from(build_parser(argv).parse_args(argv)).api_server_count == 1


def test_embeddings_refuse_an_adapter():
    """A pooling server with adapters embeds with the base model only: an adapter's name is a
    400 before anything runs (no engine needed to see it)."""
    import asyncio

    from mm_serve.entrypoints.openai.errors import APIError
    from mm_serve.entrypoints.openai.protocol_embeddings import EmbeddingRequest
    from mm_serve.entrypoints.openai.serving_common import Admission, ModelInfo
    from mm_serve.entrypoints.openai.serving_embeddings import ServingEmbedding

    info = ModelInfo((MODEL,), "/base", {"qv": LoRARequest("qv", 1, "/qv")})
    embedding = ServingEmbedding(None, info, Admission(1), None)
    with pytest.raises(APIError, match="not served for embeddings") as error:
        asyncio.run(embedding.create(EmbeddingRequest(model="qv", input="a"), 0.0))
    assert error.value.status == 400


def test_run_batch_serves_lora_modules(checkpoint, offline, tmp_path):
    """``mm-serve run-batch --enable-lora --lora-modules``: a line naming an adapter gets that
    adapter's greedy tokens (the offline engine's), a line naming the base model the base's."""
    path, adapters = checkpoint
    lines = [
        {"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "return_token_ids": True}}
        for model in (MODEL, "qv") for i, prompt in enumerate(PROMPTS)
    ]  # fmt: skip
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", "run-batch", path, *ENGINE]
    command += ["--served-model-name", MODEL, "--lora-modules", f"qv={adapters['qv-r8']}"]
    command += ["-i", str(source), "-o", str(results)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = [json.loads(line) for line in results.read_text().splitlines()]
    got = {o["custom_id"]: o["response"]["body"]["choices"][0]["token_ids"] for o in outputs}
    expected = {model: offline_tokens(offline, model) for model in (MODEL, "qv")}
    assert expected["qv"] != expected[MODEL]  # the adapter changes the tokens
    for model, tokens in expected.items():
        assert [got[f"{model}-{i}"] for i in range(len(PROMPTS))] == tokens, model
