"""Run from the repository root (``''`` first on ``sys.path``), the folder ``kernels/`` is also
found as a top-level package ``kernels``, the name of Hugging Face's kernels library.
transformers' probe for that library (``is_kernels_available``, run when
``transformers.processing_utils`` is imported) finds no distribution named ``kernels`` and
imports the folder; that import must neither fail nor need an installed ``mm_serve``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# 1. torchvision made importable on a CPU host (mm_serve.utils._compat), then every mm_serve module
#    forgotten and made unimportable, as in a checkout that is not installed.
# 2. The import that ran the probe on the GPU machine, then the probe's verdict.
PROBE = """
import importlib.abc, sys
from mm_serve.utils._compat import ensure_torchvision_importable
ensure_torchvision_importable()
assert "transformers" not in sys.modules

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mm_serve":
            raise ModuleNotFoundError(f"No module named {name!r}")

for name in [m for m in sys.modules if m.split(".")[0] == "mm_serve"]:
    del sys.modules[name]
sys.meta_path.insert(0, NotInstalled())

import transformers.processing_utils
from transformers.utils.import_utils import is_kernels_available
print(sys.modules["kernels"].__file__, is_kernels_available(), sorted(vars(sys.modules["kernels"])))
"""


def test_transformers_probe_for_hub_kernels_from_the_repository_root() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    module_file, available, names = proc.stdout.splitlines()[-1].split(" ", 2)
    assert Path(module_file) == REPO / "kernels" / "__init__.py"  # the probe did import it
    assert available == "False"
    assert "rms_norm" not in names  # as a top-level package it defines nothing of ours
