"""The README's offline example, saved as a script without an ``if __name__ == "__main__":``
guard and run with ``python file.py``, prints the answer and exits 0: the preprocessing
workers (and a spawned engine core) never run the user's main script again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mm_serve import LLM, SamplingParams
from mm_serve.testing.vlm_checkpoints import build_tiny_vlm_checkpoint

REPO = Path(__file__).resolve().parents[1]

# Exactly the README's snippet; MODEL_PATH is replaced by the test checkpoint's folder.
README_SNIPPET = """\
from mm_serve import LLM, SamplingParams
llm = LLM(model="MODEL_PATH")
image_part = {"type": "image_url", "image_url": {"url": "samples/demo_vlm/example.png"}}
messages = [{"role": "user", "content": [image_part, {"type": "text", "text": "Describe the image."}]}]
print(llm.chat(messages, SamplingParams(max_tokens=64))[0].outputs[0].text)
"""  # noqa: E501


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=0)


def test_readme_snippet_runs_as_an_unguarded_script(checkpoint, tmp_path):
    script = tmp_path / "describe.py"
    script.write_text(README_SNIPPET.replace("MODEL_PATH", checkpoint))
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, timeout=300
    )
    stderr = run.stderr.decode(errors="replace")
    assert run.returncode == 0, stderr[-3000:]
    assert "BrokenProcessPool" not in stderr
    # The same question in this process gives the text the script printed.
    llm = LLM(model=checkpoint)
    image_part = {
        "type": "image_url",
        "image_url": {"url": str(REPO / "samples/demo_vlm/example.png")},
    }
    messages = [
        {"role": "user", "content": [image_part, {"type": "text", "text": "Describe the image."}]}
    ]
    expected = llm.chat(messages, SamplingParams(max_tokens=64), use_tqdm=False)[0].outputs[0]
    llm.shutdown()
    assert len(expected.token_ids) > 0 and expected.text.strip()
    assert run.stdout.decode() == expected.text + "\n"
