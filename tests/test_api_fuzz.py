"""A fuzz pass over the OpenAPI document: no request the schema allows (or nearly allows) makes a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from live_server import API_KEY, Server  # noqa: E402


@pytest.fixture(scope="module")
def live(tiny_checkpoint):
    server = Server(tiny_checkpoint, context=96)      # small: generated requests finish fast on a CPU
    yield server
    server.close()


def test_no_server_errors_over_the_openapi_document(live):
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{live.port}/openapi.json")
    checked = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def no_5xx(case):
            response = case.call(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
            assert response.status_code < 500, \
                f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"

        no_5xx()
        checked.append(f"{operation.method.upper()} {operation.path}")
        assert live.supervisor.state == "ready"
    assert "POST /v1/chat/completions" in checked and "POST /generate" in checked and len(checked) == 9
