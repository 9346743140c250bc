"""The fleet's requests (heartbeats, leases, renewals, releases, submits; ``proxy.coordinator.fleet``) on a real
port with a real Redis: each answered by its one async route, awaited on the server's loop with no thread, its
refusals with their codes, a missing state rebuilt, and a Redis that does not answer answered ``unavailable``."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import fastapi.dependencies.utils
import fastapi.routing
import httpx
import pytest
import starlette.requests

from asyncgrpo.protocol.schemas import LeaseGrant
from proxy.api import edge
from proxy.api.app import create_app
from proxy.api.edge import FleetRoute
from proxy.coordinator.scripts import ASYNC_CALL_TIMEOUT_S
from proxy.coordinator.service import Coordinator
from proxy.coordinator.snapshot import load_snapshot
from tests.integration.test_proxy_metrics import first_use
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.fixtures_redis import free_port
from tests.support.proxy_harness import ManualClock, advance_version, leased_versions, start_run, submission

AUTH = {"Authorization": f"Bearer {API_TOKEN}", "Content-Type": "application/json"}
BEAT = {"worker_id": "gen-1", "role": "generate", "hostname": "h", "pid": 7, "state": "idle", "incarnation": "a1"}
HEARTBEAT = "/v1/workers/heartbeat"
LEASES = "/v1/leases"
ROLLOUTS = "/v1/rollouts"


@contextmanager
def proxy(coord: Coordinator, redis_url: str | None = None) -> Iterator[httpx.Client]:
    """The proxy's app on a real port; ``redis_url``: the fleet's client's server (None: the coordinator's)."""
    app = create_app(coord, API_TOKEN, run_loop=False, redis_url=redis_url)
    with served(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def timed_routes(coord: Coordinator) -> set[str]:
    return {
        sample.labels["route"]
        for metric in coord.metrics.registry.collect()
        if metric.name == "asyncgrpo_http_request_seconds"
        for sample in metric.samples
        if sample.name.endswith("_count")
    }


def lease_body(task_id: str, worker_id: str = "gen-1", **fields: object) -> dict[str, object]:
    return {"worker_id": worker_id, "task_id": task_id, "incarnation": "a1", **fields}


def submit_body(coord: Coordinator, task: dict, lease_id: str | None, **fields: object) -> bytes:
    body = json.loads(submission(coord, task, coord.current_version(), lease=False).model_dump_json())
    return json.dumps({**body, "lease_id": lease_id, **fields}).encode()


# ---- one way: async routes, no thread ----


def test_the_fleets_requests_wait_in_no_thread(coord: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    """FastAPI runs a synchronous endpoint, dependency or response check through ``run_in_threadpool``: none of
    the fleet's requests goes there; a synchronous route (``/v1/status``) does, so the check can fail."""
    start_run(coord)
    task = coord.dispatcher.generate[0]
    threaded: list[str] = []

    def recording(original: Callable[..., Any]) -> Callable[..., Any]:
        async def run(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            threaded.append(getattr(func, "__name__", repr(func)))
            return await original(func, *args, **kwargs)

        return run

    for module in (fastapi.routing, fastapi.dependencies.utils):
        monkeypatch.setattr(module, "run_in_threadpool", recording(module.run_in_threadpool))
    with proxy(coord) as client:
        assert client.post(HEARTBEAT, json=BEAT, headers=AUTH).status_code == 200
        grant = client.post(LEASES, json=lease_body(task["task_id"]), headers=AUTH).json()
        assert client.post(f"{LEASES}/{grant['lease_id']}/renew", json={}, headers=AUTH).status_code == 200
        spare = client.post(LEASES, json=lease_body(task["task_id"]), headers=AUTH).json()["lease_id"]
        assert client.delete(f"{LEASES}/{spare}", headers=AUTH).json() == {"released": True}
        answer = client.post(ROLLOUTS, content=submit_body(coord, task, grant["lease_id"]), headers=AUTH)
        assert answer.json() == {"status": "admitted"}, answer.text
        assert client.post(HEARTBEAT, json={**BEAT, "pid": "x"}, headers=AUTH).status_code == 422
        assert threaded == [], f"the fleet's requests ran {threaded} in a thread"
        assert client.get("/v1/status", headers=AUTH).status_code == 200
        assert threaded, "a synchronous route runs in a thread: the check sees it"


# ---- heartbeats ----


def test_a_heartbeat_is_recorded_and_a_restart_told_apart(coord: Coordinator) -> None:
    start_run(coord)
    with proxy(coord) as client:
        answer = client.post(HEARTBEAT, json=BEAT, headers=AUTH)
        assert (answer.status_code, answer.json()) == (200, {"ok": True})
        (record,) = coord.workers()
        assert (record.worker_id, record.pid, record.incarnation, record.alive) == ("gen-1", 7, "a1", True)
        client.post(HEARTBEAT, json={**BEAT, "incarnation": "b2"}, headers=AUTH)
        assert coord.workers()[0].restarts == 1, "a new incarnation under the same id is a restart"
    assert HEARTBEAT in timed_routes(coord)


def test_a_redis_that_never_answers_is_answered_unavailable_after_the_default_timeout(coord: Coordinator) -> None:
    """The fleet's client reaches something that accepts but never replies (a hung Redis): with the default
    ``ASYNC_CALL_TIMEOUT_S`` the request is answered 503 ``unavailable`` (the worker's retry), nothing recorded."""
    start_run(coord)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with proxy(coord, f"redis://127.0.0.1:{silent.getsockname()[1]}/0") as client:
            started = time.monotonic()
            answer = client.post(HEARTBEAT, json=BEAT, headers=AUTH)
            waited = time.monotonic() - started
    assert (answer.status_code, answer.json()["error"]) == (503, "unavailable"), answer.text
    assert ASYNC_CALL_TIMEOUT_S <= waited < ASYNC_CALL_TIMEOUT_S + 10
    assert coord.workers() == []


def test_a_redis_that_refuses_connections_is_answered_unavailable(coord: Coordinator) -> None:
    start_run(coord)
    task_id = coord.dispatcher.generate[0]["task_id"]
    with proxy(coord, f"redis://127.0.0.1:{free_port()}/0") as client:
        for path, body in ((HEARTBEAT, BEAT), (LEASES, lease_body(task_id))):
            answer = client.post(path, json=body, headers=AUTH)
            assert (answer.status_code, answer.json()["error"]) == (503, "unavailable"), path
    assert leased_versions(coord, task_id, "gen-1") == set()


# ---- leases and renewals ----


def test_a_lease_and_its_renewal_are_granted(coord: Coordinator, clock: ManualClock) -> None:
    start_run(coord)
    task_id = coord.dispatcher.generate[0]["task_id"]
    with proxy(coord) as client:
        answer = client.post(LEASES, json=lease_body(task_id), headers=AUTH)
        assert answer.status_code == 200, answer.text
        grant = LeaseGrant.model_validate(answer.json())
        assert grant.version == 0 and grant.manifest_sha256 == coord.version_info(0).manifest_sha256
        record = coord.redis.hgetall(coord.keys.lease(grant.lease_id))
        assert (record["worker_id"], record["task_id"], record["incarnation"]) == ("gen-1", task_id, "a1")
        assert leased_versions(coord, task_id, "gen-1") == {0}, "the submission is bound to this lease"
        assert first_use(coord)[0] == 1, "the first lease of version 0 observed its wait"
        assert task_id in coord.pacer._leased_ms, "the pacer saw the lease start"

        clock.advance(5)
        renewed = client.post(f"{LEASES}/{grant.lease_id}/renew", json={}, headers=AUTH)
        assert renewed.status_code == 200, renewed.text
        assert LeaseGrant.model_validate(renewed.json()).expires_at == grant.expires_at + 5
        assert coord.redis.zscore(coord.keys.leases, grant.lease_id) == (grant.expires_at + 5) * 1000
    assert {LEASES, "/v1/leases/{lease_id}/renew"} <= timed_routes(coord), "timed under the routes' labels"


def refused_requests(coord: Coordinator) -> list[tuple[str, str, bytes, dict[str, str], int, str]]:
    """(what, path, body, headers, status, error code)."""
    task_id = coord.dispatcher.generate[0]["task_id"]
    plain = {"Authorization": f"Bearer {API_TOKEN}"}
    lease = json.dumps(lease_body(task_id)).encode()
    lost = f"{LEASES}/{'f' * 32}/renew"
    return [
        ("unknown task", LEASES, json.dumps(lease_body(f"gen-{coord.run}-nope")).encode(), AUTH, 410, "cancelled"),
        ("unknown field", LEASES, json.dumps(lease_body(task_id, y=1)).encode(), AUTH, 422, "bad_request"),
        (
            "bad worker id",
            LEASES,
            json.dumps(lease_body(task_id, worker_id="a b")).encode(),
            AUTH,
            422,
            "bad_request",
        ),
        ("not JSON", LEASES, b'{"worker_id":', AUTH, 422, "bad_request"),
        ("text content type", LEASES, lease, {**plain, "Content-Type": "text/plain"}, 422, "bad_request"),
        ("query string", f"{LEASES}?x=1", lease, AUTH, 422, "bad_request"),
        ("lost lease", lost, b"{}", AUTH, 410, "lease_lost"),
        ("bad lease id", f"{LEASES}/a%20b/renew", b"{}", AUTH, 422, "bad_request"),
        ("renewal field", lost, b'{"y": 1}', AUTH, 422, "bad_request"),
        ("no token", LEASES, lease, {"Content-Type": "application/json"}, 401, "unauthorized"),
    ]


@pytest.mark.parametrize("index", range(10))
def test_refusals_are_answered_with_their_codes_and_change_nothing(coord: Coordinator, index: int) -> None:
    start_run(coord)
    what, path, body, headers, status, code = refused_requests(coord)[index]
    before = coord.redis.zcard(coord.keys.leases)
    with proxy(coord) as client:
        answer = client.post(path, content=body, headers=headers)
    assert (answer.status_code, answer.json()["error"]) == (status, code), (what, answer.text)
    assert coord.redis.zcard(coord.keys.leases) == before, what


def test_a_lease_after_redis_lost_its_state_is_answered_after_a_rebuild(coord: Coordinator) -> None:
    """The script finds no state: the state is rebuilt from the bucket and the lease runs again (the tasks in
    flight at the loss are cancelled by the rebuild); the next task's lease is granted."""
    start_run(coord)
    coord.snapshots.write(force=True)
    task_id = coord.dispatcher.generate[0]["task_id"]
    coord.redis.flushdb()
    with proxy(coord) as client:
        answer = client.post(LEASES, json=lease_body(task_id), headers=AUTH)
        assert (answer.status_code, answer.json()["error"]) == (410, "cancelled"), answer.text
        assert coord.current_version() == 0, "rebuilt from the bucket"
        coord.tick()
        fresh = coord.dispatcher.generate[-1]["task_id"]
        assert client.post(LEASES, json=lease_body(fresh), headers=AUTH).status_code == 200
    assert leased_versions(coord, fresh, "gen-1") == {0}


# ---- submits ----


def test_a_submit_is_admitted_and_durable_before_its_answer(coord: Coordinator) -> None:
    start_run(coord)
    task = coord.dispatcher.generate[0]
    with proxy(coord) as client:
        lease_id = client.post(LEASES, json=lease_body(task["task_id"]), headers=AUTH).json()["lease_id"]
        answer = client.post(ROLLOUTS, content=submit_body(coord, task, lease_id), headers=AUTH)
        assert (answer.status_code, answer.json()) == (200, {"status": "admitted"})
        # Right after the answer: the bucket's snapshot and log hold it as buffered.
        buffered = {item["task_id"] for item in load_snapshot(coord.bucket, coord.run)["buffer"]}
        assert task["task_id"] in buffered
        assert not coord.redis.exists(coord.keys.lease(lease_id)), "the submission released its lease"
        again = client.post(ROLLOUTS, content=submit_body(coord, task, lease_id), headers=AUTH)
        assert (again.status_code, again.json()) == (200, {"status": "duplicate"})
    assert coord.status().counters["rollouts_admitted"] == 1
    assert ROLLOUTS in timed_routes(coord)


def test_submits_refused_stale_and_cancelled_are_answered_and_counted(coord: Coordinator, clock: ManualClock) -> None:
    """A wrong key, another worker's task, stale, cancelled: each its status and code, and what it counts."""
    start_run(coord)
    task, late = coord.dispatcher.generate[:2]
    coord.lease("gen-1", late["task_id"])  # on v0, submitted once v2 is out: stale
    with proxy(coord) as client:
        lease_id = client.post(LEASES, json=lease_body(task["task_id"]), headers=AUTH).json()["lease_id"]
        wrong_key = client.post(
            ROLLOUTS, content=submit_body(coord, task, lease_id, key="runs/r1/rollouts/elsewhere.bin"), headers=AUTH
        )
        assert (wrong_key.status_code, wrong_key.json()["error"]) == (400, "bad_request")
        other = client.post(ROLLOUTS, content=submit_body(coord, task, None, worker_id="gen-9"), headers=AUTH)
        assert (other.status_code, other.json()["error"]) == (409, "not_holder")
        assert client.post(ROLLOUTS, content=submit_body(coord, task, lease_id), headers=AUTH).status_code == 200
        submitted = {task["task_id"], late["task_id"]}
        advance_version(coord, submitted)
        advance_version(coord, submitted)
        stale = client.post(
            ROLLOUTS, json=json.loads(submission(coord, late, 0, lease=False).model_dump_json()), headers=AUTH
        )
        assert (stale.status_code, stale.json()["error"]) == (409, "stale"), stale.text
        assert (stale.json()["version"], stale.json()["current_version"]) == (0, 2)
        cancelled = next(t for t in coord.dispatcher.generate if t["task_id"] not in submitted)
        clock.advance(coord.config.async_.generate_task_timeout_s + 1)
        coord.tick()  # every task in flight timed out: cancelled
        gone = client.post(ROLLOUTS, content=submit_body(coord, cancelled, None), headers=AUTH)
        assert (gone.status_code, gone.json()["error"]) == (410, "cancelled")
    assert coord.status().counters["rollouts_stale"] == 1


# ---- one definition: FastAPI's route; FleetRoute only validates a plain request in one pass ----


def fastapi_handlers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on the fleet's routes take no request themselves: FastAPI's own handler answers every one, through
    the router (what FleetRoute and FleetDispatch must answer alike)."""

    async def none(*_: object) -> None:
        return None

    monkeypatch.setattr(FleetRoute, "values", none)


def beat(worker_id: str, **fields: object) -> bytes:
    return json.dumps(
        {"worker_id": worker_id, "role": "generate", "hostname": "h", "pid": 1, "state": "idle", **fields}
    ).encode()


PLAIN = {"Authorization": f"Bearer {API_TOKEN}"}
ODD_REQUESTS: list[tuple[str, str, str, bytes, dict[str, str]]] = [
    ("beat", "POST", HEARTBEAT, beat("gen-2"), AUTH),
    ("beat, no content type", "POST", HEARTBEAT, beat("gen-3"), PLAIN),
    ("beat, text", "POST", HEARTBEAT, beat("gen-4"), {**PLAIN, "Content-Type": "text/plain"}),
    ("beat, charset", "POST", HEARTBEAT, beat("gen-4"), {**PLAIN, "Content-Type": "application/json; charset=utf-8"}),
    ("beat, unknown field", "POST", HEARTBEAT, beat("gen-5", y=1), AUTH),
    ("beat, bad role", "POST", HEARTBEAT, beat("gen-6", role="judge"), AUTH),
    ("beat, NaN pid", "POST", HEARTBEAT, beat("gen-7", pid=1).replace(b'"pid": 1', b'"pid": NaN'), AUTH),
    ("beat, pid as text", "POST", HEARTBEAT, beat("gen-7", pid="12"), AUTH),
    ("beat, not JSON", "POST", HEARTBEAT, b'{"worker_id":', AUTH),
    ("beat, empty", "POST", HEARTBEAT, b"", AUTH),
    ("beat, deep JSON", "POST", HEARTBEAT, b"[" * 5_000 + b"]" * 5_000, AUTH),
    ("beat, query", "POST", f"{HEARTBEAT}?verbose=1", beat("gen-8"), AUTH),
    ("lease, unknown task", "POST", LEASES, json.dumps(lease_body("gen-r1-nope")).encode(), AUTH),
    ("lease, null incarnation", "POST", LEASES, json.dumps(lease_body("gen-r1-nope", incarnation=None)).encode(), AUTH),
    ("renew, lost", "POST", f"{LEASES}/{'f' * 32}/renew", b"{}", AUTH),
    ("renew, no body", "POST", f"{LEASES}/{'f' * 32}/renew", b"", PLAIN),
    ("renew, null body", "POST", f"{LEASES}/{'f' * 32}/renew", b"null", AUTH),
    ("renew, field", "POST", f"{LEASES}/{'f' * 32}/renew", b'{"y": 1}', AUTH),
    ("renew, bad id", "POST", f"{LEASES}/a%20b/renew", b"{}", AUTH),
    ("renew, long id", "POST", f"{LEASES}/{'a' * 200}/renew", b"{}", AUTH),
    ("release, lost", "DELETE", f"{LEASES}/{'f' * 32}", b"", PLAIN),
    ("release, bad id", "DELETE", f"{LEASES}/-x", b"", PLAIN),
    ("release, query", "DELETE", f"{LEASES}/{'f' * 32}?force=1", b"", PLAIN),
    ("submit, empty", "POST", ROLLOUTS, b"{}", AUTH),
    ("submit, list", "POST", ROLLOUTS, b"[]", AUTH),
    *(
        (f"poll {query or 'plain'}", "GET", f"/v1/versions/latest{query}", b"", PLAIN)
        for query in (
            "",
            "?after=-1",
            "?after=0&wait_s=0",
            "?after=3&wait_s=0.01",
            "?wait_s=0",
            "?after=-2",
            "?after=1.0",
            "?after=%2B1",
            "?after=",
            "?after=%20",
            "?wait_s=31",
            "?wait_s=-1",
            "?wait_s=1e-3",
            "?wait_s=nan",
            "?after=0&after=1",
            "?verbose=1",
        )
    ),
]


@pytest.mark.parametrize("index", range(len(ODD_REQUESTS)), ids=[r[0] for r in ODD_REQUESTS])
def test_every_fleet_request_is_answered_as_fastapis_own_handler_answers_it(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    start_run(coord)
    what, method, path, body, headers = ODD_REQUESTS[index]
    answers = []
    for own in (False, True):
        if own:
            fastapi_handlers_only(monkeypatch)
        with proxy(coord) as client:
            answer = client.request(method, path, content=body, headers=headers)
            answers.append((answer.status_code, answer.json()))
    assert answers[0] == answers[1], what


def test_plain_fleet_requests_skip_fastapis_dependency_machinery(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FleetDispatch answers plain requests (a check that it still applies after a FastAPI upgrade): none goes
    through the router or ``solve_dependencies``; a request it hands on (a body its model refuses) goes through
    both, so the check can fail."""
    start_run(coord)
    task = coord.dispatcher.generate[0]
    solved: list[str] = []
    original = fastapi.routing.solve_dependencies

    async def recording(*args: Any, **kwargs: Any) -> Any:
        solved.append(kwargs["request"].url.path)
        return await original(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", recording)
    routed: list[str] = []
    route_handle = FleetRoute.handle

    async def through_the_router(self: FleetRoute, scope: Any, receive: Any, send: Any) -> None:
        routed.append(scope["path"])
        await route_handle(self, scope, receive, send)

    monkeypatch.setattr(FleetRoute, "handle", through_the_router)
    with proxy(coord) as client:
        assert client.post(HEARTBEAT, json=BEAT, headers=AUTH).status_code == 200
        grant = client.post(LEASES, json=lease_body(task["task_id"]), headers=AUTH).json()
        assert client.post(f"{LEASES}/{grant['lease_id']}/renew", headers=PLAIN).status_code == 200
        assert client.get("/v1/versions/latest?after=-1&wait_s=0", headers=PLAIN).status_code == 200
        answer = client.post(ROLLOUTS, content=submit_body(coord, task, grant["lease_id"]), headers=AUTH)
        assert answer.json() == {"status": "admitted"}, answer.text
        assert client.delete(f"{LEASES}/{grant['lease_id']}", headers=PLAIN).json() == {"released": False}
        assert (solved, routed) == ([], []), "answered by FleetDispatch, past the router"
        assert client.post(HEARTBEAT, json={**BEAT, "pid": "x"}, headers=AUTH).status_code == 422
        assert (solved, routed) == ([HEARTBEAT], [HEARTBEAT])


def test_plain_fleet_requests_are_read_once_and_build_no_request(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The body AuthAndTiming read (to limit it) is the one FleetDispatch validates: no request's messages are
    buffered twice, and none builds a Starlette ``Request``; one FastAPI answers (a refused body) does both."""
    start_run(coord)
    task = coord.dispatcher.generate[0]
    buffered: list[int] = []
    original_read = edge._read_messages

    async def recording_read(receive: Any) -> Any:
        buffered.append(1)
        return await original_read(receive)

    monkeypatch.setattr(edge, "_read_messages", recording_read)
    built: list[str] = []
    original_init = starlette.requests.Request.__init__

    def recording_init(self: starlette.requests.Request, scope: Any, *args: Any, **kwargs: Any) -> None:
        built.append(scope["path"])
        original_init(self, scope, *args, **kwargs)

    monkeypatch.setattr(starlette.requests.Request, "__init__", recording_init)
    with proxy(coord) as client:
        assert client.post(HEARTBEAT, json=BEAT, headers=AUTH).status_code == 200
        grant = client.post(LEASES, json=lease_body(task["task_id"]), headers=AUTH).json()
        assert client.post(f"{LEASES}/{grant['lease_id']}/renew", json={}, headers=AUTH).status_code == 200
        answer = client.post(ROLLOUTS, content=submit_body(coord, task, grant["lease_id"]), headers=AUTH)
        assert answer.json() == {"status": "admitted"}, answer.text
        assert (buffered, built) == ([], []), "the body read once, no Request built"
        assert client.post(HEARTBEAT, json={**BEAT, "pid": "x"}, headers=AUTH).status_code == 422
        assert set(built) == {HEARTBEAT}, "FastAPI's own answer builds Requests (so the check can fail)"
