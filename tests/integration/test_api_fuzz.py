"""The proxy's API fuzzed from its own ``/openapi.json`` (schemathesis) over a real port and a real Redis.

The proxy is fuzzed in each state an operator meets: ``before_v0`` (run created, the init step claimed, no
worker and no version yet), ``mid_run`` (leases, buffered rollouts and a started step in flight, workers
heard from), ``finished`` (the final version published) and ``standby`` (a stand-by proxy that took the
mid-run state over when the live one's leadership lapsed). Before this, only a proxy at version 0 was fuzzed, and a
``base`` step failure before version 0 answered 500.

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

from asyncgrpo.protocol.schemas import HeartbeatRequest, StepStartRequest
from proxy.api.app import create_app, take_leadership
from proxy.api.version_watch import MAX_WAIT_S
from proxy.coordinator.service import Coordinator
from proxy.coordinator.snapshot import Leadership
from tests.support.dispatcher import RecordingDispatcher
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.fixtures_redis import RedisServer
from tests.support.proxy_harness import (
    ManualClock,
    advance_version,
    file_bucket,
    lease_task,
    make_coordinator,
    small_config,
    start_run,
    submission,
)

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
"""A database of the session's private Redis of its own: each state's run lives while its tests run."""
STATES = ["before_v0", "mid_run", "finished", "standby"]
FINAL_VERSION = 2
"""The final version of the ``finished`` run (``optimizer.total_steps``)."""


def _heard_from(coord: Coordinator) -> None:
    for worker_id, role in (("gen-1", "generate"), ("opt-1", "optimize")):
        coord.heartbeat(HeartbeatRequest(worker_id=worker_id, role=role, hostname="fuzz-host", pid=1, state="busy"))


def _before_v0(coord: Coordinator) -> Coordinator:
    coord.tick()  # the init step is claimed; nothing else can happen before version 0
    assert coord.status().step_inflight == 0
    return coord


def _mid_run(coord: Coordinator) -> Coordinator:
    start_run(coord)
    _heard_from(coord)
    submitted: set[str] = set()
    advance_version(coord, submitted)

    def submit_next() -> dict:
        task = next(t for t in coord.dispatcher.generate if t["task_id"] not in submitted)
        submitted.add(task["task_id"])
        coord.submit(submission(coord, task, coord.current_version()))
        return task

    while coord.tick().step_claimed is None:
        submit_next()
    submit_next()  # buffered for the next step
    coord.tick()
    lease_task(coord, next(t for t in coord.dispatcher.generate if t["task_id"] not in submitted))  # in flight
    step = coord.status().step_inflight
    assert step is not None
    batch = coord.get_step(step)
    coord.start_step(
        step,
        StepStartRequest(
            worker_id="opt-1", base_version=batch.base_version, task_ids=[r.task_id for r in batch.rollouts]
        ),
    )
    return coord


def _finished(coord: Coordinator) -> Coordinator:
    start_run(coord)
    submitted: set[str] = set()
    while coord.current_version() < FINAL_VERSION:
        advance_version(coord, submitted)
    coord.tick()
    return coord


def _standby(coord: Coordinator) -> Coordinator:
    """The stand-by that took over ``coord``'s run (same Redis and bucket) once its leadership lapsed."""
    assert coord.leadership is not None
    _mid_run(coord)
    coord.snapshots.write(force=True)
    coord.redis.delete(coord.leadership.keys.proxy_leadership)  # the live proxy died; its leadership lapsed
    leadership = Leadership(coord.redis, coord.run)
    assert take_leadership(leadership, coord.bucket, standby=True) == coord.leadership.epoch + 1
    standby = make_coordinator(
        coord.redis,
        coord.bucket,
        config=coord.config,
        clock=ManualClock(),
        dispatcher=RecordingDispatcher(),
        leadership=leadership,
    )
    standby.tick()
    return standby


@pytest.fixture(scope="module", params=STATES)
def proxy_url(
    request: pytest.FixtureRequest, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    state = request.param
    redis = Redis(host=redis_server.host, port=redis_server.port, db=FUZZ_DB, decode_responses=True)
    redis.flushdb()
    bucket = file_bucket(Path(tmp_path_factory.mktemp(f"fuzz-{state}")))
    config = small_config()
    if state == "finished":
        config = config.model_copy(
            update={"optimizer": config.optimizer.model_copy(update={"total_steps": FINAL_VERSION})}
        )
    leadership = None
    if state == "standby":
        leadership = Leadership(redis, "r1")
        take_leadership(leadership, bucket, standby=False)
    coord = make_coordinator(
        redis, bucket, config=config, clock=ManualClock(), dispatcher=RecordingDispatcher(), leadership=leadership
    )
    coord = {"before_v0": _before_v0, "mid_run": _mid_run, "finished": _finished, "standby": _standby}[state](coord)
    # With the loop's answers (proxy.api.loop_routes), as ``serve`` runs it: they must answer as the routes do.
    loop_redis = f"redis://{redis_server.host}:{redis_server.port}/{FUZZ_DB}"
    app = create_app(coord, API_TOKEN, run_loop=False, stop_on_lost_leadership=lambda: None, redis_url=loop_redis)
    with served(app) as url:
        yield url
    redis.flushdb()


@pytest.fixture(scope="module")
def api_schema(proxy_url: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{proxy_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def _short_long_poll(case: schemathesis.Case) -> None:
    # The long poll may wait up to MAX_WAIT_S for a version nobody publishes here; a valid wait is cut short
    # (an invalid one stays as generated, to be refused).
    # (Before version 0 a wait after -1 really waits.) Explicit examples may carry the number as text.
    wait = (case.query or {}).get("wait_s")
    if isinstance(wait, str):
        try:
            wait = float(wait)
        except ValueError:
            return
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
