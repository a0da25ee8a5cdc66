"""ARCHITECTURE.md and the README's request walk name files, classes and methods that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Each document, and the section of it that walks a request (None: all of it).
DOCS = {"ARCHITECTURE.md": None, "README.md": "## One request through the code"}
# Names of other libraries that the walk mentions.
EXTERNAL = {"ProcessPoolExecutor", "DecodeStream"}


def _tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return [f for f in out.stdout.split() if (REPO / f).exists()]  # not deleted meanwhile


def _python_source() -> str:
    return "\n".join((REPO / f).read_text() for f in _tracked_files() if f.endswith(".py"))


def _code_spans(doc: str) -> list[str]:
    text = (REPO / doc).read_text()
    if DOCS[doc] is not None:
        text = text.split(DOCS[doc], 1)[1].split("\n## ", 1)[0]
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks: examples, not names
    return [s.removesuffix("()") for s in re.findall(r"`([^`\n]+)`", text)]


@pytest.mark.parametrize("doc", DOCS)
def test_named_files_exist(doc: str) -> None:
    files = _tracked_files()
    folders = {str(Path(f).parent) + "/" for f in files}
    paths = [s for s in _code_spans(doc) if re.fullmatch(r"[\w./-]+(\.py|/)", s)]
    assert paths  # the parse found them
    missing = [
        p
        for p in paths
        if not any(f == p or f.endswith("/" + p) for f in files)
        and not any(d == p or d.endswith("/" + p) for d in folders)
    ]
    assert sorted(missing) == []


@pytest.mark.parametrize("doc", DOCS)
def test_named_classes_and_methods_exist(doc: str) -> None:
    """``Class``, ``Class.method`` and ``function`` spans (a CamelCase name, or a snake_case
    name with an underscore that is defined somewhere) are defined in the library."""
    source = _python_source()
    names = [s for s in _code_spans(doc) if re.fullmatch(r"[A-Z]\w*[a-z]\w*(\.\w+)?", s)]
    assert names
    missing = []
    for name in set(names) - EXTERNAL:
        owner, _, member = name.partition(".")
        defined = re.search(rf"^\s*(class|def) {owner}\b|^{owner} = ", source, re.MULTILINE)
        if member and defined:
            pattern = rf"^\s*(async )?def {member}\b|^\s+{member}\b.*[:=]"
            defined = re.search(pattern, source, re.MULTILINE)
        if not defined:
            missing.append(name)
    assert sorted(missing) == []
