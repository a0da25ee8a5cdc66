"""The ``mm-serve`` console script.

``mm-serve serve`` starts the engine core process before anything else: parsing its flags
imports torch and the web stack (seconds), and the process imports the engine meanwhile (with
data parallelism it is the first replica; Ray actors replace it with ``--data-parallel-backend
ray``). Every other command goes straight to ``cli.main``.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    from mm_serve.utils import quiet_exit

    quiet_exit.install()
    argv = sys.argv[1:]
    engine_process = None
    if argv[:1] == ["serve"] and not {"-h", "--help"} & set(argv):
        cache_bytecode(argv)
        if _flag_value(argv, "--data-parallel-backend") != "ray":
            from mm_serve.frontend.engine_process import start_engine_core

            engine_process = start_engine_core(_api_server_count(argv))
    try:
        from mm_serve.entrypoints.cli import main as cli_main

        exit_code = cli_main(argv, engine_process)
        if exit_code == 0:
            quiet_exit.mark_clean()
        return exit_code
    finally:  # a no-op once the engine core client took the process over and shut it down
        if engine_process is not None:
            engine_process.stop()


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value ``argv`` gives ``flag`` (``--flag value`` or ``--flag=value``; the last
    one), else None."""
    value = None
    for arg, following in zip(argv, [*argv[1:], None], strict=True):
        if arg == flag:
            value = following
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def _api_server_count(argv: list[str]) -> int:
    """The engine core's clients: ``--api-server-count`` (1 when absent or not a count; the
    server then starts the engine core again for the right count)."""
    value = _flag_value(argv, "--api-server-count") or "1"
    return int(value) if value.isdigit() and int(value) > 0 else 1


def cache_bytecode(argv: list[str]) -> None:
    """Where Python writes no bytecode (``PYTHONDONTWRITEBYTECODE``, as container images often
    set) for packages installed without it, each of the server's processes compiles torch's
    and transformers' sources again at every start, seconds apiece. Then re-run the command
    (``os.execve``, same pid) with bytecode kept under ``cache_root()/pycache``
    (``PYTHONPYCACHEPREFIX``: no file is written beside a source), so that the next start
    reads it. ``MM_SERVE_PYCACHE=0`` leaves Python as it is.
    """
    if not sys.flags.dont_write_bytecode or os.environ.get("MM_SERVE_PYCACHE") == "0":
        return
    from mm_serve.utils.cache_dir import cache_root

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.setdefault("PYTHONPYCACHEPREFIX", str(cache_root() / "pycache"))
    os.execve(sys.executable, [sys.executable, "-m", "mm_serve.entrypoints.launch", *argv], env)


if __name__ == "__main__":
    sys.exit(main())
