"""Embeddings of a tiny Qwen2-VL checkpoint under the pooling runner (``--runner pooling``),
against HF's final hidden states pooled by hand: ``LLM.embed`` (whole and chunked prompts,
last-token and mean pooling, text and images), ``/v1/embeddings`` on a real server (the same
embeddings, the official SDK's base64, Matryoshka ``dimensions``, the 400s) and
``mm-serve run-batch`` with embeddings lines."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from mm_serve import LLM, PoolingParams
from tests.fixtures.server import image_question, noise_png_url, serve_checked
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

MIN_COSINE = 0.9999
ENGINE = {"max_model_len": 512, "num_kv_blocks": 64}
SERVER_ARGS = ["--runner", "pooling", "--max-model-len", "512", "--num-kv-blocks", "64"]
IMAGE_TAG = "<|vision_start|><|image_pad|><|vision_end|>"
TEXTS = ["A short sentence.", "Another, longer sentence about a red bicycle leaning on a wall."]
MATRYOSHKA_DIMENSIONS = [16, 32]


def image(seed: int, height: int, width: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_prompts() -> list[dict]:
    return [
        {"prompt": f"{IMAGE_TAG}Describe it.", "multi_modal_data": {"image": image(1, 84, 56)}},
        {
            "prompt": f"Left {IMAGE_TAG} and right {IMAGE_TAG} pictures.",
            "multi_modal_data": {"image": [image(2, 56, 112), image(3, 70, 70)]},
        },
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("gme"), "qwen2_vl", seed=7)


@pytest.fixture(scope="module")
def mean_checkpoint(checkpoint, tmp_path_factory) -> str:
    """The checkpoint as a sentence-transformers folder: mean pooling, then Normalize; and
    trained for Matryoshka truncation (``matryoshka_dimensions`` in config.json)."""
    path = tmp_path_factory.mktemp("gme_mean") / "model"
    shutil.copytree(checkpoint, path)
    parts = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": folder, "type": f"sentence_transformers.models.{kind}"}
        for i, (folder, kind) in enumerate(parts)
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    config = json.loads((path / "config.json").read_text())
    config["matryoshka_dimensions"] = MATRYOSHKA_DIMENSIONS
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


class HFPooled:
    """HF's Qwen2-VL on the same folder: the last layer's hidden states after the final norm
    (``output_hidden_states=True``), pooled and L2-normalised by hand."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    @torch.no_grad()
    def embed(self, prompt: str | dict, pooling: str) -> tuple[list[int], np.ndarray]:
        """(the prompt's token ids, its embedding ``[hidden]``)."""
        text = prompt if isinstance(prompt, str) else prompt["prompt"]
        images = None if isinstance(prompt, str) else prompt["multi_modal_data"]["image"]
        inputs = self.processor(text=[text], images=images, return_tensors="pt")
        hidden = self.model(**inputs, output_hidden_states=True).hidden_states[-1][0]
        pooled = hidden[-1] if pooling == "LAST" else hidden.mean(dim=0)
        embedding = torch.nn.functional.normalize(pooled, dim=-1)
        return inputs["input_ids"][0].tolist(), embedding.numpy()


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_embeddings_match_hf(checkpoint, mean_checkpoint, pooling, chunked):
    path = checkpoint if pooling == "LAST" else mean_checkpoint
    # Chunked: 8-token steps cut the prompts, and their images, over several steps, each
    # scheduled while the one before runs (async scheduling).
    chunking = {"max_num_batched_tokens": 8, "block_size": 4, "async_scheduling": True}
    chunking = chunking if chunked else {}
    llm = LLM(path, runner="pooling", **ENGINE, **chunking)
    prompts = [*TEXTS, *image_prompts()]
    outputs = llm.embed(prompts, use_tqdm=False)
    reference = HFPooled(path)
    for prompt, output in zip(prompts, outputs, strict=True):
        token_ids, expected = reference.embed(prompt, pooling)
        assert output.prompt_token_ids == token_ids
        assert cosine(output.outputs.embedding, expected) > MIN_COSINE
        assert np.linalg.norm(output.outputs.embedding) == pytest.approx(1.0, abs=1e-5)
    assert llm.config.cache.enable_prefix_caching is False
    llm.shutdown()


def test_offline_options_and_refusals(mean_checkpoint, vlm_llm):
    llm = LLM(mean_checkpoint, runner="pooling", pooler_config={"normalize": False}, **ENGINE)
    raw = np.array(llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding)
    assert raw.shape == (64,) and abs(np.linalg.norm(raw) - 1.0) > 1e-3
    cut = llm.embed(TEXTS[0], PoolingParams(dimensions=16, normalize=True), use_tqdm=False)
    # Matryoshka: the first values, renormalised.
    expected = raw[:16] / np.linalg.norm(raw[:16])
    np.testing.assert_allclose(cut[0].outputs.embedding, expected, atol=1e-6)
    with pytest.raises(ValueError, match="dimensions must be one of"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=20))
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate(TEXTS[0])
    llm.shutdown()
    with pytest.raises(ValueError, match="--runner pooling"):
        vlm_llm.embed(TEXTS[0])


@pytest.fixture(scope="module")
def pooling_server(checkpoint):
    yield from serve_checked(checkpoint, SERVER_ARGS)


@pytest.fixture(scope="module")
def offline(checkpoint):
    llm = LLM(checkpoint, runner="pooling", **ENGINE)
    yield llm
    llm.shutdown()


def chat_embedding_body(seed: int) -> dict:
    url = noise_png_url(seed, 56 + 14 * seed, 84)
    return {"messages": image_question(url, f"Picture {seed}.")}


def test_served_equals_offline(pooling_server, offline):
    with httpx.Client(base_url=pooling_server.url, timeout=120) as client:
        texts = client.post("/v1/embeddings", json={"input": TEXTS}).json()
        tokens = client.post("/v1/embeddings", json={"input": [[5, 6, 7, 8]]}).json()
        chat = client.post("/v1/embeddings", json=chat_embedding_body(1)).json()
    expected = offline.embed([*TEXTS, {"prompt_token_ids": [5, 6, 7, 8]}], use_tqdm=False)
    served = [d["embedding"] for d in texts["data"] + tokens["data"]]
    for got, want in zip(served, expected, strict=True):
        assert cosine(got, want.outputs.embedding) > MIN_COSINE
    assert texts["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in expected[:2])
    assert texts["usage"]["total_tokens"] == texts["usage"]["prompt_tokens"]
    # The chat form: the messages as the chat template renders them (no generation prompt).
    rendered = offline.input_processor.apply_chat_template(
        chat_embedding_body(1)["messages"], add_generation_prompt=False
    )
    (want,) = offline.embed(rendered, use_tqdm=False)
    assert chat["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert cosine(chat["data"][0]["embedding"], want.outputs.embedding) > MIN_COSINE


def test_openai_sdk_and_base64(pooling_server):
    """The official SDK asks for base64 (float32 little-endian) and decodes it."""
    import openai

    client = openai.OpenAI(base_url=f"{pooling_server.url}/v1", api_key="unused", max_retries=0)
    response = client.embeddings.create(model=pooling_server.model, input=TEXTS)
    with httpx.Client(base_url=pooling_server.url, timeout=120) as http:
        floats = http.post("/v1/embeddings", json={"input": TEXTS}).json()["data"]
        body = {"input": TEXTS, "encoding_format": "base64"}
        encoded = http.post("/v1/embeddings", json=body).json()["data"]
    for sdk, plain, b64 in zip(response.data, floats, encoded, strict=True):
        decoded = np.frombuffer(base64.b64decode(b64["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.float32(plain["embedding"]))
        np.testing.assert_allclose(sdk.embedding, plain["embedding"], rtol=1e-6, atol=1e-7)


BAD_BODIES = [
    ({"input": "x", "dimensions": 16}, "dimensions"),  # not a Matryoshka model
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({}, "input"),
    ({"input": "x", **chat_embedding_body(0)}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
]


@pytest.mark.parametrize("body, param", BAD_BODIES)
def test_bad_embedding_requests(pooling_server, body, param):
    response = httpx.post(f"{pooling_server.url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_wrong_runner_is_a_400(pooling_server, vlm_server):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = httpx.post(f"{pooling_server.url}/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    response = httpx.post(f"{vlm_server.url}/v1/embeddings", json={"input": "Hi"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    assert "--runner pooling" in response.json()["error"]["message"]


def batch_line(custom_id: str, body: dict, url: str = "/v1/embeddings") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_run_batch_embeddings(checkpoint, pooling_server, tmp_path: Path):
    bodies = [{"input": TEXTS}, {"input": TEXTS[1]}, chat_embedding_body(2), chat_embedding_body(3)]
    lines = [batch_line(f"embed-{i}", body) for i, body in enumerate(bodies)]
    lines.append(batch_line("bad-dimensions", {"input": "x", "dimensions": 8}))
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    lines.append(batch_line("chat", chat, "/v1/chat/completions"))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "mm_serve.entrypoints.launch", "run-batch", checkpoint]
    command += ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), *SERVER_ARGS]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]  # two lines got an error
    outputs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == [json.loads(line)["custom_id"] for line in lines]
    with httpx.Client(base_url=pooling_server.url, timeout=120) as client:
        for line, output in zip(lines, outputs, strict=True):
            item = json.loads(line)
            served = client.post(item["url"], json=item["body"])
            assert output["response"]["status_code"] == served.status_code
            body = output["response"]["body"]
            if served.status_code != 200:
                assert body["error"] == served.json()["error"]
                continue
            assert output["error"] is None and body["usage"] == served.json()["usage"]
            for got, want in zip(body["data"], served.json()["data"], strict=True):
                assert cosine(got["embedding"], want["embedding"]) > MIN_COSINE
