"""The proxy's API fuzzed from its own ``/openapi.json`` (schemathesis) over a real port and a real Redis.

Every operation gets schema-valid and schema-breaking requests (with the token; ``ignored_auth`` also tries
without it). Each answer must not be a 5xx, must have a status the schema documents for that operation, must
match the body schema documented for that status (``ErrorBody`` for refusals), and a request that breaks the
schema must be refused. Refusals a valid request can earn (a stale rollout, an unknown task) are fine: the
fuzzer does not know the run's state, so ``positive_data_acceptance`` is not asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from redis import Redis
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from proxy.api.app import create_app
from proxy.api.version_watch import MAX_WAIT_S
from tests.fixtures_coordinator import API_TOKEN, served
from tests.fixtures_redis import RedisServer
from tests.proxy_harness import ManualClock, file_bucket, make_coordinator, start_run

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
    unsupported_method,
]
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}
FUZZ_DB = 7
"""A database of the session's private Redis of its own: the served run lives for the whole module."""


@pytest.fixture(scope="module")
def proxy_url(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    redis = Redis(host=redis_server.host, port=redis_server.port, db=FUZZ_DB, decode_responses=True)
    redis.flushdb()
    coord = start_run(make_coordinator(redis, file_bucket(Path(tmp_path_factory.mktemp("fuzz"))), clock=ManualClock()))
    with served(create_app(coord, API_TOKEN, run_loop=False)) as url:
        yield url
    redis.flushdb()


@pytest.fixture(scope="module")
def api_schema(proxy_url: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{proxy_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def _short_long_poll(case: schemathesis.Case) -> None:
    # The long poll may wait up to MAX_WAIT_S for a version nobody publishes here; a valid wait is cut short
    # (an invalid one stays as generated, to be refused).
    wait = (case.query or {}).get("wait_s")
    if isinstance(wait, int | float) and not isinstance(wait, bool) and 0 <= wait <= MAX_WAIT_S:
        case.query["wait_s"] = min(wait, 0.01)


@schema.parametrize()
@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_5xx_and_every_answer_is_documented(case: schemathesis.Case, proxy_url: str) -> None:
    _short_long_poll(case)
    case.call_and_validate(base_url=proxy_url, headers=AUTH, checks=CHECKS)
