"""``mm-serve run-batch`` as a user runs it (a real process, files on disk): one output line
per input line in input order, each answered as the server answers the same body; bad lines
get error lines and the rest go on."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.fixtures.server import (
    VLM_MAX_MODEL_LEN,
    VLM_NUM_KV_BLOCKS,
    VLM_SERVED_NAME,
    image_question,
    noise_png_url,
)

NUM_IMAGE_LINES = 40


def chat_body(i: int) -> dict:
    url = noise_png_url(i, 28 + 14 * (i % 4), 56 + 14 * (i % 3))
    return {
        "model": VLM_SERVED_NAME,
        "messages": image_question(url, f"Question {i}: what is in this picture?"),
        "max_tokens": 8,
        "temperature": 0,
    }


def batch_line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


BAD_TEMPERATURE = {**chat_body(0), "temperature": -1}
COMPLETION = {"model": VLM_SERVED_NAME, "prompt": "The picture", "max_tokens": 6, "temperature": 0}
# (input line, expected custom_id, expected status): the bad lines among the good ones.
BAD_LINES = [
    ("{this is not json", None, 400),
    (json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}), None, 400),
    (batch_line("wrong-url", COMPLETION, "/v1/embeddings"), "wrong-url", 400),
    (batch_line("streamed", {**COMPLETION, "stream": True}, "/v1/completions"), "streamed", 400),
    (batch_line("bad-temperature", BAD_TEMPERATURE), "bad-temperature", 400),
    (batch_line("unknown-model", {**COMPLETION, "model": "nope"}, "/v1/completions"),
     "unknown-model", 404),
]  # fmt: skip


@pytest.fixture(scope="module")
def batch(vlm_path, tmp_path_factory):
    """(input lines, output lines, exit code) of one run-batch over the image lines, a
    completion line and the bad lines."""
    lines = [batch_line(f"image-{i}", chat_body(i)) for i in range(NUM_IMAGE_LINES)]
    lines.insert(7, batch_line("completion", COMPLETION, "/v1/completions"))
    for k, (line, _, _) in enumerate(BAD_LINES):
        lines.insert(3 + 5 * k, line)
    folder = tmp_path_factory.mktemp("batch")
    (folder / "in.jsonl").write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "mm_serve.entrypoints.launch", "run-batch", vlm_path]
    command += ["-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl")]
    command += ["--served-model-name", VLM_SERVED_NAME, "--max-model-len", str(VLM_MAX_MODEL_LEN)]
    command += ["--num-kv-blocks", str(VLM_NUM_KV_BLOCKS), "--max-concurrent-requests", "16"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    outputs = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    return lines, outputs, done.returncode


def test_every_line_is_answered_in_order(batch):
    lines, outputs, returncode = batch
    assert len(outputs) == len(lines)
    assert returncode == 1  # some lines got an error
    for line, output in zip(lines, outputs, strict=True):
        bad = next((b for b in BAD_LINES if b[0] == line), None)
        if bad is None:
            assert output["custom_id"] == json.loads(line)["custom_id"]
            assert output["error"] is None and output["response"]["status_code"] == 200
        else:
            assert output["custom_id"] == bad[1]
            assert output["response"]["status_code"] == bad[2]
            assert output["error"]["message"] == output["response"]["body"]["error"]["message"]
    assert len({output["id"] for output in outputs}) == len(outputs)


def test_answers_equal_the_servers(batch, vlm_server):
    lines, outputs, _ = batch
    with httpx.Client(base_url=vlm_server.url, timeout=120) as client:
        for line, output in zip(lines, outputs, strict=True):
            item = json.loads(line) if line.startswith('{"custom_id"') else None
            if item is None or item["url"] == "/v1/embeddings" or item["body"].get("stream"):
                continue
            served = client.post(item["url"], json=item["body"])
            body = output["response"]["body"]
            assert output["response"]["status_code"] == served.status_code
            if served.status_code == 200:
                expected = served.json()
                assert body["choices"] == expected["choices"] and body["model"] == expected["model"]
                # The shared server's prefix cache holds other tests' prompts: cached counts differ.
                counts = ("prompt_tokens", "completion_tokens", "total_tokens")
                assert [body["usage"][k] for k in counts] == [expected["usage"][k] for k in counts]
                assert output["response"]["request_id"] == body["id"]
            else:
                assert body == served.json()
