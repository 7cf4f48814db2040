"""Schemathesis against the server's own OpenAPI schema: no input may produce a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from infer_lab.serve.server import make_app
from tests.live_server import metric, running, wait_for


@pytest.fixture(scope="module")
def fuzz_base():
    # A short context keeps every generated request cheap: most are refused, the rest are tiny.
    app = make_app(None, device="cpu", num_kv_blocks=64, max_num_seqs=16, max_model_len=48)
    with running(app) as base:
        yield base


def test_no_server_errors(fuzz_base):
    api = schemathesis.openapi.from_url(f"{fuzz_base}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    statuses: set[int] = set()
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=60, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def no_5xx(case):
            response = case.call(base_url=fuzz_base, timeout=60)
            statuses.add(response.status_code)
            assert response.status_code < 500, (case.path, case.body, response.text)

        no_5xx()
    assert statuses & {200} and statuses & {400}  # both accepted and refused inputs were tried
    assert wait_for(lambda: metric(fuzz_base, "kv_cache_blocks_used") == 0)
