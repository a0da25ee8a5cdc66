"""The ``mm-serve`` console script.

``mm-serve serve`` starts the engine core process before anything else: parsing its flags
imports torch and the web stack (seconds), and the process imports the engine meanwhile.
Every other command goes straight to ``cli.main``.
"""

from __future__ import annotations

import sys


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] != ["serve"] or {"-h", "--help"} & set(argv):
        from mm_serve.entrypoints.cli import main as cli_main

        return cli_main(argv)
    from mm_serve.frontend.engine_process import start_engine_core

    engine_process = start_engine_core()
    try:
        from mm_serve.entrypoints.cli import main as cli_main

        return cli_main(argv, engine_process)
    finally:  # a no-op once the engine core client took it over and shut it down
        engine_process.discard()


if __name__ == "__main__":
    sys.exit(main())
