"""Folders are processes and layers: the API server's process loads no scheduler, model runner
or model; the engine core process loads no web stack; no import goes from a lower layer to a
higher one (ARCHITECTURE.md's list, ``LAYERS``); no import cycle.

The process checks import the module in a fresh interpreter and read ``sys.modules``; the
graph checks read every library file's imports with ``ast`` (``if TYPE_CHECKING:`` blocks are
skipped; imports inside functions count for the layers and for the cycles).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

REPO = Path(__file__).resolve().parents[1]
# Package -> folder, as in pyproject.toml's [tool.setuptools.package-dir].
PACKAGE_DIRS = {
    "mm_serve": "mm_serve",
    "mm_serve.cache": "cache",
    "mm_serve.encoders": "encoders",
    "mm_serve.kernels": "kernels",
}
ENGINE_CORE_PACKAGES = ("mm_serve.sched", "mm_serve.worker", "mm_serve.models", "mm_serve.engine")
WEB_STACK = ("fastapi", "starlette", "uvicorn", "pydantic")


def loaded_modules(module: str, then: str = "pass") -> list[str]:
    """The modules a fresh interpreter holds after ``import module`` and the statement ``then``."""
    code = f"import json, sys; import {module}; {then}; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_api_server_loads_no_engine_core_module() -> None:
    modules = loaded_modules("mm_serve.entrypoints.openai.api_server")
    assert "mm_serve.frontend.async_llm" in modules  # the import did reach the front end
    assert [m for m in modules if _in(m, ENGINE_CORE_PACKAGES)] == []


def test_resolving_the_config_loads_no_engine_core_module(tmp_path) -> None:
    """The API server resolves the config (config.json, the image processor's token counts)
    without the model loader; the engine core process gets the result."""
    path = build_tiny_vlm_checkpoint(tmp_path, "qwen2_vl", seed=0)
    resolve = (
        f"from mm_serve.config import EngineArgs; EngineArgs(model={path!r}).create_engine_config()"
    )
    modules = loaded_modules("mm_serve.entrypoints.openai.api_server, mm_serve.config", resolve)
    assert "mm_serve.checkpoint.hub" in modules
    assert [m for m in modules if _in(m, ENGINE_CORE_PACKAGES)] == []


@pytest.mark.parametrize("module", ["mm_serve.engine.core_proc", "mm_serve.entrypoints.llm"])
def test_engine_core_loads_no_web_stack(module: str) -> None:
    modules = loaded_modules(module)
    assert "mm_serve.sched.scheduler" in modules
    assert [m for m in modules if _in(m, WEB_STACK)] == []
    assert [m for m in modules if _in(m, ("mm_serve.entrypoints.openai",))] == []


def _module_files() -> dict[str, Path]:
    files = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            files.setdefault(".".join((package, *parts)), path)
    return files


def _imports(name: str, path: Path, known: set[str], lazy: bool) -> set[str]:
    """Modules that module ``name`` imports: its module-level statements, not under
    ``if TYPE_CHECKING:``, and with ``lazy`` those inside its functions too; ``from a import b``
    names ``a.b`` if that is a module, else ``a``."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not lazy and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = name.split(".")[: len(name.split(".")) - child.level + is_package]
                    base = ".".join([*parts, *([child.module] if child.module else [])])
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in known else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    """Library module -> the modules (library or not) it imports at module level (with
    ``lazy``, in its functions too)."""
    files = _module_files()
    return {name: _imports(name, path, set(files), lazy) for name, path in files.items()}


def _loads(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module importing ``module`` runs: its imports, their parent packages, and theirs."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(graph.get(name, ()))
    return seen


def test_no_module_loads_both_the_scheduler_and_the_web_server() -> None:
    graph = import_graph()
    both = [
        name
        for name in graph
        if "mm_serve.sched.scheduler" in (loads := _loads(graph, name))
        and loads & {"fastapi", "uvicorn"}
    ]
    assert both == []


# The layers of ARCHITECTURE.md, lowest first: a module imports (at module level or in a
# function) only modules of its own layer or a lower one. A module's layer is that of the
# longest package prefix listed; ``mm_serve`` itself (the public API: ``LLM``) is the top.
LAYERS = (
    ("mm_serve.utils", "mm_serve.distributed", "mm_serve.checkpoint"),
    ("mm_serve.kernels", "mm_serve.models.layers", "mm_serve.encoders", "mm_serve.cache"),
    ("mm_serve.config",),
    ("mm_serve.messages", "mm_serve.lora.request"),
    ("mm_serve.models", "mm_serve.preprocess", "mm_serve.lora"),
    ("mm_serve.sched",),
    ("mm_serve.worker",),
    ("mm_serve.engine",),
    ("mm_serve.frontend",),
    ("mm_serve.entrypoints", "mm_serve.client", "mm_serve"),
    ("mm_serve.benchmarks",),
)


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of ``module``'s longest listed package prefix, else None."""
    best, found = -1, None
    for index, packages in enumerate(LAYERS):
        for package in packages:
            if _in(module, (package,)) and len(package) > best:
                best, found = len(package), index
    return found


def test_every_module_has_a_layer() -> None:
    graph = import_graph()
    assert [m for m in graph if layer_of(m) is None] == []


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    graph = import_graph(lazy=True)
    upward = [
        f"{name} (layer {layer_of(name)}) -> {target} (layer {layer_of(target)})"
        for name, targets in graph.items()
        for target in targets
        if target in graph and layer_of(target) is not None
        if layer_of(target) > layer_of(name)
    ]
    assert upward == []


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "with-lazy"])
def test_no_import_cycle(lazy: bool) -> None:
    graph = import_graph(lazy)
    cycles = []
    for start in graph:
        # A cycle through ``start``: a path of library imports that leads back to it.
        stack, seen = [(start, (start,))], set()
        while stack:
            name, path = stack.pop()
            for target in graph.get(name, ()):
                if target == start:
                    cycles.append(path)
                elif target in graph and target not in seen:
                    seen.add(target)
                    stack.append((target, (*path, target)))
    assert cycles == []


def test_the_engine_core_process_starts_before_torch_is_imported() -> None:
    """``mm-serve serve`` starts the engine core first (``entrypoints.launch``): what that
    needs loads no torch, so the process imports the engine while the server imports torch."""
    modules = loaded_modules("mm_serve.entrypoints.launch, mm_serve.frontend.engine_process")
    assert "mm_serve.frontend.engine_process" in modules
    assert [m for m in modules if m == "torch" or m.startswith("torch.")] == []


def test_benchmarks_hold_only_what_a_bench_command_reaches() -> None:
    """Every module of ``mm_serve.benchmarks`` is one a ``mm-serve bench`` subcommand imports,
    directly or through others (function-level imports included)."""
    from mm_serve.entrypoints.cli import BENCH_COMMANDS

    graph = import_graph(lazy=True)
    reached = set()
    for module, _ in BENCH_COMMANDS.values():
        reached |= _loads(graph, f"mm_serve.benchmarks.{module}")
    package = {name for name in graph if _in(name, ("mm_serve.benchmarks",))}
    assert sorted(package - reached) == []


def test_tests_reach_the_benchmarks_through_the_cli() -> None:
    """No test file imports ``mm_serve.benchmarks`` (they run ``mm-serve bench ...``)."""
    importing = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(_in(name, ("mm_serve.benchmarks",)) for name in names):
                importing.append(path.name)
                break
    assert importing == []
