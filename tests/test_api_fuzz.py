"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (``/openapi.json``) with
schemathesis: bodies, paths and query strings generated from each operation's schema, valid
and not, a bounded number per operation. No answer may be a 5xx, and the server must still be
healthy and hold no request afterwards.

The server is a tiny Qwen2-VL with a short context, so that a generated request (any
``max_tokens``, ``n`` up to 128) finishes in a moment.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.fixtures.server import RemoteServer, assert_group_gone, metric
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

EXAMPLES_PER_OPERATION = 40  # a few hundred cases: the GET operations without parameters run once
ARGS = ["--max-model-len", "128", "--num-kv-blocks", "256", "--mm-preprocess-workers", "1"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("fuzz_vlm"), "qwen2_vl", seed=8)
    remote = RemoteServer(path, ARGS)
    yield remote
    with httpx.Client(base_url=remote.url, timeout=30) as client:
        assert client.get("/health").status_code == 200  # alive after the fuzzing
        text = client.get("/metrics").text
        assert metric(text, "mm_serve_num_requests_running") == 0
        assert metric(text, "mm_serve_num_requests_waiting") == 0
    assert remote.stop() == 0
    assert_group_gone(remote.proc.pid)


def check_operation(operation, base_url: str) -> None:
    """Run the operation's generated cases; raises AssertionError at a 5xx (shrunk)."""

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def run(case) -> None:
        response = case.call(base_url=base_url, timeout=60)
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} -> {response.status_code}: "
            f"{response.text[:500]}\nbody: {str(case.body)[:1000]}"
        )

    run()


def test_no_server_error(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:
        try:
            check_operation(operation, server.url)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n\n".join(failures)
