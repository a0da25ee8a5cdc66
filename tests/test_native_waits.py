"""``benchmarks/native_waits``: a py-spy raw profile's samples by thread, and the innermost
named frame of each stack with the engine's line above it."""

from __future__ import annotations

from mm_serve.benchmarks.native_waits import engine_frame, named_leaf, parse

RAW = """\
process 7:python -m x;thread (11): MainThread;step (mm_serve/engine/core.py:130);\
replay (torch/cuda/graphs.py:90);cuGraphLaunch (libcuda.so.1);0x7f01 (libcuda.so.1) 30
process 7:python -m x;thread (11): MainThread;step (mm_serve/engine/core.py:130);\
get (mm_serve/worker/step_output.py:40);cudaEventSynchronize (libcudart.so.12);\
0x7f02 (libcuda.so.1) 10
process 7:python -m x;thread (12): engine-core-input;poll (zmq/sugar/socket.py:1) 5
not a stack line
"""


def test_parse_groups_samples_by_thread(tmp_path) -> None:
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    threads = parse(str(path))
    main = threads["process 7:python -m x / thread (11): MainThread"]
    assert sum(main.values()) == 40
    assert sum(threads["process 7:python -m x / thread (12): engine-core-input"].values()) == 5
    stacks = sorted(main, key=main.get, reverse=True)
    assert named_leaf(stacks[0]) == "cuGraphLaunch (libcuda.so.1)"
    assert named_leaf(stacks[1]) == (
        "cudaEventSynchronize (libcudart.so.12) [innermost in (libcuda.so.1)]"
    )
    assert engine_frame(stacks[1]) == "get (mm_serve/worker/step_output.py:40)"
    assert engine_frame(("poll (zmq/sugar/socket.py:1)",)) == "?"
    benchmark = ("step (mm_serve/engine/core.py:130)", "timed (mm_serve/benchmarks/x.py:9)")
    assert engine_frame(benchmark) == "step (mm_serve/engine/core.py:130)"
