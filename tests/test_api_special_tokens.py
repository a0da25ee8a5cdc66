"""vLLM's ``add_special_tokens`` over HTTP (completions: default true; chat: default false),
against a real ``mm-serve serve`` subprocess of a tiny Llama, whose tokenizer prepends BOS and
whose chat template writes it, checked against HF's tokenizer."""

from __future__ import annotations

import httpx
import pytest

from tests.fixtures.checkpoints import build_tiny_checkpoint
from tests.fixtures.server import http_client

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=2)


@pytest.fixture(scope="module")
def http(path):
    args = ["--max-model-len", "128", "--num-kv-blocks", "32", "--served-model-name", MODEL]
    yield from http_client(path, args, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def prompt_ids(http: httpx.Client, path: str, **fields) -> list[int]:
    body = {"model": MODEL, "max_tokens": 2, "return_token_ids": True} | fields
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    return reply.get("prompt_token_ids") or reply["choices"][0]["prompt_token_ids"]


def test_completions_add_special_tokens_as_hf(http, tokenizer):
    text = "The quick brown fox"
    with_bos = tokenizer(text).input_ids
    assert with_bos[0] == tokenizer.bos_token_id
    assert prompt_ids(http, "/v1/completions", prompt=text) == with_bos
    assert prompt_ids(http, "/v1/completions", prompt=text, add_special_tokens=True) == with_bos
    without = prompt_ids(http, "/v1/completions", prompt=text, add_special_tokens=False)
    assert without == tokenizer(text, add_special_tokens=False).input_ids == with_bos[1:]
    echoed = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": text, "max_tokens": 2, "echo": True}
        | {"add_special_tokens": False},
    )
    assert echoed.json()["choices"][0]["text"].startswith(text)


def test_chat_add_special_tokens_as_vllm(http, tokenizer):
    """Default: the template's BOS alone; true: the tokenizer's BOS too (vLLM's)."""
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith(tokenizer.bos_token)
    once = tokenizer(text, add_special_tokens=False).input_ids
    assert prompt_ids(http, "/v1/chat/completions", messages=MESSAGES) == once
    twice = prompt_ids(http, "/v1/chat/completions", messages=MESSAGES, add_special_tokens=True)
    assert twice == [tokenizer.bos_token_id, *once]
