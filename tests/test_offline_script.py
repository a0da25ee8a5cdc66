"""The README's offline example, saved as a script without an ``if __name__ == "__main__":``
guard and run with ``python file.py``, prints the answer and exits 0: the preprocessing
workers (and a spawned engine core) never run the user's main script again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mm_serve import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]


def readme_snippet() -> str:
    """The first Python block of the README's "Offline API" section, exactly as printed."""
    section = (REPO / "README.md").read_text().split("## Offline API", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_snippet_runs_as_an_unguarded_script(tmp_path):
    snippet = readme_snippet()
    assert "__main__" not in snippet and 'LLM(model="samples/demo_vlm/model")' in snippet
    script = tmp_path / "describe.py"
    script.write_text(snippet)
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, timeout=300
    )
    stderr = run.stderr.decode(errors="replace")
    assert run.returncode == 0, stderr[-3000:]
    assert "BrokenProcessPool" not in stderr
    # The same question in this process gives the text the script printed.
    llm = LLM(model=str(REPO / "samples/demo_vlm/model"))
    image_part = {
        "type": "image_url",
        "image_url": {"url": str(REPO / "samples/demo_vlm/example.png")},
    }
    messages = [
        {
            "role": "user",
            "content": [image_part, {"type": "text", "text": "What is in the picture?"}],
        }
    ]
    expected = llm.chat(messages, SamplingParams(max_tokens=64), use_tqdm=False)[0].outputs[0]
    llm.shutdown()
    assert expected.text.startswith("The image shows")  # the demo answers what people ask
    assert run.stdout.decode() == expected.text + "\n"
