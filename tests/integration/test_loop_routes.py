"""The fleet's requests answered on the event loop (``proxy.api.loop_routes``), on a real port with a real Redis:
heartbeats, leases, renewals and the long poll recorded and answered exactly as their routes record and answer
them, and every request off that path (or refused) answered by the route, alike."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from fastapi import FastAPI

from asyncgrpo.protocol.schemas import LeaseGrant
from proxy.api.app import create_app
from proxy.api.loop_routes import (
    HEARTBEAT_PATH,
    LATEST_PATH,
    LEASES_PATH,
    RENEW_PATH,
    ROLLOUTS_PATH,
    LoopAnswers,
    LoopRoutes,
)
from proxy.coordinator.scripts import ASYNC_CALL_TIMEOUT_S
from proxy.coordinator.service import Coordinator
from proxy.coordinator.snapshot import load_snapshot
from tests.integration.test_proxy_metrics import first_use
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.fixtures_redis import free_port
from tests.support.proxy_harness import ManualClock, advance_version, leased_versions, start_run, submission

AUTH = {"Authorization": f"Bearer {API_TOKEN}", "Content-Type": "application/json"}
BEAT = {"worker_id": "gen-1", "role": "generate", "hostname": "h", "pid": 7, "state": "idle", "incarnation": "a1"}


def routes_only(app: FastAPI) -> FastAPI:
    """``app`` without the loop's answers: every request reaches its route (what the loop must equal)."""
    app.user_middleware = [m for m in app.user_middleware if m.cls is not LoopRoutes]
    return app


@contextmanager
def proxy(
    coord: Coordinator, redis_url: str | None, *, loop: bool = True
) -> Iterator[tuple[httpx.Client, LoopAnswers]]:
    app = create_app(coord, API_TOKEN, run_loop=False, redis_url=redis_url)
    if not loop:
        routes_only(app)
    with served(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client, app.state.loop_answers


def timed_routes(coord: Coordinator) -> set[str]:
    return {
        sample.labels["route"]
        for metric in coord.metrics.registry.collect()
        if metric.name == "asyncgrpo_http_request_seconds"
        for sample in metric.samples
        if sample.name.endswith("_count")
    }


def the_route_must_not_answer(coord: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> bool:
        raise AssertionError("the heartbeat reached the route")

    monkeypatch.setattr(coord, "heartbeat", refuse)


def test_a_heartbeat_is_recorded_on_the_event_loop(
    coord: Coordinator, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_run(coord)
    the_route_must_not_answer(coord, monkeypatch)
    with proxy(coord, redis_url) as (client, heartbeats):
        answer = client.post("/v1/workers/heartbeat", json=BEAT, headers=AUTH)
        assert (answer.status_code, answer.json()) == (200, {"ok": True})
        assert answer.headers["content-type"] == "application/json"
        assert heartbeats.served[HEARTBEAT_PATH] == 1
        (record,) = coord.workers()
        assert (record.worker_id, record.pid, record.incarnation, record.alive) == ("gen-1", 7, "a1", True)
        # a new incarnation under the same id is a restart, as through the route
        client.post("/v1/workers/heartbeat", json={**BEAT, "incarnation": "b2"}, headers=AUTH)
        assert coord.workers()[0].restarts == 1
    assert HEARTBEAT_PATH in timed_routes(coord), "timed under the route's label, as the route's answers are"


def test_a_heartbeat_the_loop_gets_no_reply_for_is_recorded_by_the_route(coord: Coordinator) -> None:
    """The loop's client reaches something that never answers (a hung Redis): after ASYNC_CALL_TIMEOUT_S, the
    default, the route answers through the coordinator's own client."""
    start_run(coord)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        with proxy(coord, url) as (client, answers):
            started = time.monotonic()
            answer = client.post("/v1/workers/heartbeat", json=BEAT, headers=AUTH)
            waited = time.monotonic() - started
            assert (answer.status_code, answer.json()) == (200, {"ok": True})
            assert answers.served[HEARTBEAT_PATH] == 0
    assert ASYNC_CALL_TIMEOUT_S <= waited < ASYNC_CALL_TIMEOUT_S + 10
    assert [record.worker_id for record in coord.workers()] == ["gen-1"]


def beat(worker_id: str, **fields: object) -> bytes:
    return json.dumps(
        {"worker_id": worker_id, "role": "generate", "hostname": "h", "pid": 1, "state": "idle", **fields}
    ).encode()


def off_path_requests() -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(what, query, body, headers): one on the loop's path, the others off it."""
    plain = {"Authorization": f"Bearer {API_TOKEN}"}
    return [
        ("valid", "", beat("gen-2"), AUTH),
        ("no content type", "", beat("gen-3"), plain),
        ("text content type", "", beat("gen-4"), {**plain, "Content-Type": "text/plain"}),
        ("unknown field", "", beat("gen-5", y=1), AUTH),
        ("bad role", "", beat("gen-6", role="judge"), AUTH),
        ("NaN pid", "", beat("gen-7", pid=1).replace(b'"pid": 1', b'"pid": NaN'), AUTH),
        ("not JSON", "", b'{"worker_id":', AUTH),
        ("deep JSON", "", b"[" * 5_000 + b"]" * 5_000, AUTH),
        ("query string", "?verbose=1", beat("gen-8"), AUTH),
    ]


@pytest.mark.parametrize(
    ("what", "query", "body", "headers"), off_path_requests(), ids=[c[0] for c in off_path_requests()]
)
def test_every_heartbeat_is_answered_as_the_route_answers_it(
    coord: Coordinator, redis_url: str, what: str, query: str, body: bytes, headers: dict[str, str]
) -> None:
    start_run(coord)
    answers = []
    for url in (None, redis_url):
        with proxy(coord, url) as (client, heartbeats):
            answer = client.post(f"/v1/workers/heartbeat{query}", content=body, headers=headers)
            answers.append((answer.status_code, answer.json()))
    assert answers[0] == answers[1], what
    assert heartbeats.served[HEARTBEAT_PATH] == (1 if what == "valid" else 0)


def test_a_heartbeat_the_loop_cannot_record_is_recorded_by_the_route(coord: Coordinator) -> None:
    """Its asyncio client cannot reach Redis (here: nothing listens on its port): the route answers, through
    the coordinator's own client, and nothing is lost."""
    start_run(coord)
    with proxy(coord, f"redis://127.0.0.1:{free_port()}/0") as (client, heartbeats):
        answer = client.post("/v1/workers/heartbeat", json=BEAT, headers=AUTH)
        assert (answer.status_code, answer.json()) == (200, {"ok": True})
        assert heartbeats.served[HEARTBEAT_PATH] == 0
    assert [record.worker_id for record in coord.workers()] == ["gen-1"]


# ---- leases and renewals ----


def lease_body(task_id: str, worker_id: str = "gen-1", **fields: object) -> dict[str, object]:
    return {"worker_id": worker_id, "task_id": task_id, "incarnation": "a1", **fields}


def test_a_lease_and_its_renewal_are_granted_on_the_event_loop(
    coord: Coordinator, redis_url: str, monkeypatch: pytest.MonkeyPatch, clock: ManualClock
) -> None:
    start_run(coord)
    task_id = coord.dispatcher.generate[0]["task_id"]

    def refuse(*_: object) -> None:
        raise AssertionError("the request reached the route")

    monkeypatch.setattr(coord, "lease", refuse)
    monkeypatch.setattr(coord, "renew", refuse)
    with proxy(coord, redis_url) as (client, answers):
        answer = client.post(LEASES_PATH, json=lease_body(task_id), headers=AUTH)
        assert answer.status_code == 200, answer.text
        grant = LeaseGrant.model_validate(answer.json())
        assert grant.version == 0 and grant.manifest_sha256 == coord.version_info(0).manifest_sha256
        assert answers.served[LEASES_PATH] == 1
        record = coord.redis.hgetall(coord.keys.lease(grant.lease_id))
        assert (record["worker_id"], record["task_id"], record["incarnation"]) == ("gen-1", task_id, "a1")
        assert leased_versions(coord, task_id, "gen-1") == {0}, "the submission is bound to this lease"
        assert first_use(coord)[0] == 1, "the first lease of version 0 observed its wait"

        clock.advance(5)
        renewed = client.post(RENEW_PATH.format(lease_id=grant.lease_id), json={}, headers=AUTH)
        assert renewed.status_code == 200, renewed.text
        assert LeaseGrant.model_validate(renewed.json()).expires_at == grant.expires_at + 5
        assert answers.served[RENEW_PATH] == 1
        assert coord.redis.zscore(coord.keys.leases, grant.lease_id) == (grant.expires_at + 5) * 1000
    assert {LEASES_PATH, RENEW_PATH} <= timed_routes(coord), "timed under the routes' labels"
    monkeypatch.undo()
    assert task_id in coord.pacer._leased_ms, "the pacer saw the lease start, as through the route"


def test_a_lease_on_the_loop_answers_as_the_route_does(coord: Coordinator, redis_url: str) -> None:
    start_run(coord)
    first, second = (task["task_id"] for task in coord.dispatcher.generate[:2])
    answers = []
    for loop, task_id in ((False, first), (True, second)):
        with proxy(coord, redis_url, loop=loop) as (client, _):
            answer = client.post(LEASES_PATH, json=lease_body(task_id), headers=AUTH).json()
            renewed = client.post(RENEW_PATH.format(lease_id=answer["lease_id"]), json={}, headers=AUTH).json()
        answers.append([{k: v for k, v in a.items() if k not in ("lease_id", "expires_at")} for a in (answer, renewed)])
    assert answers[0] == answers[1]


def refused_requests(coord: Coordinator) -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(what, path, body, headers): refusals (answered on the loop as the route answers them) and requests off
    the loop's path (answered by the route)."""
    task_id = coord.dispatcher.generate[0]["task_id"]
    plain = {"Authorization": f"Bearer {API_TOKEN}"}
    lease = json.dumps(lease_body(task_id)).encode()
    return [
        ("unknown task", LEASES_PATH, json.dumps(lease_body(f"gen-{coord.run}-nope")).encode(), AUTH),
        ("unknown field", LEASES_PATH, json.dumps(lease_body(task_id, y=1)).encode(), AUTH),
        ("bad worker id", LEASES_PATH, json.dumps(lease_body(task_id, worker_id="a b")).encode(), AUTH),
        ("not JSON", LEASES_PATH, b'{"worker_id":', AUTH),
        ("no content type", LEASES_PATH, lease, plain),
        ("query string", f"{LEASES_PATH}?x=1", lease, AUTH),
        ("lost lease", RENEW_PATH.format(lease_id="f" * 32), b"{}", AUTH),
        ("bad lease id", RENEW_PATH.format(lease_id="a%20b"), b"{}", AUTH),
        ("renewal field", RENEW_PATH.format(lease_id="f" * 32), b'{"y": 1}', AUTH),
        ("empty renewal", RENEW_PATH.format(lease_id="f" * 32), b"", plain),
    ]


REFUSED_ON_THE_LOOP = {"unknown task", "lost lease"}
"""The refusals above that the loop answers itself: the others are off its path."""


@pytest.mark.parametrize("index", range(10))
def test_refusals_and_requests_off_the_path_are_answered_by_the_route(
    coord: Coordinator, redis_url: str, index: int
) -> None:
    start_run(coord)
    what, path, body, headers = refused_requests(coord)[index]
    answers = []
    for loop in (False, True):
        with proxy(coord, redis_url, loop=loop) as (client, loop_answers):
            answer = client.post(path, content=body, headers=headers)
            answers.append((answer.status_code, answer.json()))
            assert sum(loop_answers.served.values()) == 0, what
            refused_here = sum(loop_answers.refused.values())
    assert answers[0] == answers[1], what
    assert answers[0][0] != 200, what
    assert refused_here == (1 if what in REFUSED_ON_THE_LOOP else 0), what


def test_a_lease_the_loop_cannot_grant_is_granted_by_the_route(coord: Coordinator) -> None:
    """Nothing listens on the loop client's port: the route leases, through the coordinator's own client."""
    start_run(coord)
    task_id = coord.dispatcher.generate[0]["task_id"]
    with proxy(coord, f"redis://127.0.0.1:{free_port()}/0") as (client, answers):
        answer = client.post(LEASES_PATH, json=lease_body(task_id), headers=AUTH)
        assert answer.status_code == 200, answer.text
        assert answers.served[LEASES_PATH] == 0
    assert leased_versions(coord, task_id, "gen-1") == {0}


def test_a_lease_after_redis_lost_its_state_is_answered_after_a_rebuild(coord: Coordinator, redis_url: str) -> None:
    """The loop does not rebuild: its script finds no state, and the route rebuilds from the bucket and answers
    (the tasks in flight at the loss are cancelled by the rebuild). The next lease is the loop's again."""
    start_run(coord)
    coord.snapshots.write(force=True)
    task_id = coord.dispatcher.generate[0]["task_id"]
    coord.redis.flushdb()
    with proxy(coord, redis_url) as (client, answers):
        answer = client.post(LEASES_PATH, json=lease_body(task_id), headers=AUTH)
        assert (answer.status_code, answer.json()["error"]) == (410, "cancelled"), answer.text
        assert answers.served[LEASES_PATH] == 0
        assert coord.current_version() == 0, "rebuilt from the bucket"
        coord.tick()
        fresh = coord.dispatcher.generate[-1]["task_id"]
        assert client.post(LEASES_PATH, json=lease_body(fresh), headers=AUTH).status_code == 200
        assert answers.served[LEASES_PATH] == 1
    assert leased_versions(coord, fresh, "gen-1") == {0}


# ---- submits ----


def submit_body(coord: Coordinator, task: dict, lease_id: str | None, **fields: object) -> bytes:
    body = json.loads(submission(coord, task, coord.current_version(), lease=False).model_dump_json())
    return json.dumps({**body, "lease_id": lease_id, **fields}).encode()


def test_a_submit_is_admitted_on_the_event_loop_and_durable_before_its_answer(
    coord: Coordinator, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_run(coord)
    task = coord.dispatcher.generate[0]

    def refuse(*_: object) -> None:
        raise AssertionError("the request reached the route")

    monkeypatch.setattr(coord, "submit", refuse)
    with proxy(coord, redis_url) as (client, answers):
        lease_id = client.post(LEASES_PATH, json=lease_body(task["task_id"]), headers=AUTH).json()["lease_id"]
        answer = client.post(ROLLOUTS_PATH, content=submit_body(coord, task, lease_id), headers=AUTH)
        assert (answer.status_code, answer.json()) == (200, {"status": "admitted"})
        # Right after the answer: the bucket's snapshot and log hold it as buffered.
        buffered = {item["task_id"] for item in load_snapshot(coord.bucket, coord.run)["buffer"]}
        assert task["task_id"] in buffered
        assert answers.served[ROLLOUTS_PATH] == 1
        assert not coord.redis.exists(coord.keys.lease(lease_id)), "the submission released its lease"
        again = client.post(ROLLOUTS_PATH, content=submit_body(coord, task, lease_id), headers=AUTH)
        assert (again.status_code, again.json()) == (200, {"status": "duplicate"})
    assert coord.status().counters["rollouts_admitted"] == 1
    assert ROLLOUTS_PATH in timed_routes(coord)


def test_submits_on_the_loop_answer_as_the_route_does(coord: Coordinator, redis_url: str, clock: ManualClock) -> None:
    """Admitted, duplicate, refused as another worker's or for a wrong key, stale, and cancelled: each answer
    (and what it counts) is the route's."""
    start_run(coord)
    tasks = coord.dispatcher.generate[:4]
    late = {loop: tasks[2 + loop] for loop in (False, True)}
    for task in late.values():
        coord.lease("gen-1", task["task_id"])  # on v0, submitted once v2 is out: stale
    submitted = {task["task_id"] for task in late.values()}
    answers: dict[bool, list[tuple[int, str]]] = {}
    for loop in (False, True):
        task = tasks[loop]
        with proxy(coord, redis_url, loop=loop) as (client, loop_answers):
            lease_id = client.post(LEASES_PATH, json=lease_body(task["task_id"]), headers=AUTH).json()["lease_id"]
            bodies = [
                submit_body(coord, task, lease_id, key="runs/r1/rollouts/elsewhere.bin"),
                submit_body(coord, task, None, worker_id="gen-9"),
                submit_body(coord, task, lease_id),
                submit_body(coord, task, lease_id),
            ]
            replies = [client.post(ROLLOUTS_PATH, content=body, headers=AUTH) for body in bodies]
            answers[loop] = [(r.status_code, r.text.replace(task["task_id"], "<task>")) for r in replies]
            assert loop_answers.served[ROLLOUTS_PATH] == (2 if loop else 0)
            assert loop_answers.refused[ROLLOUTS_PATH] == (2 if loop else 0)
        submitted.add(task["task_id"])
    assert answers[False] == answers[True]
    assert [status for status, _ in answers[True]] == [400, 409, 200, 200]

    advance_version(coord, submitted)
    advance_version(coord, submitted)
    late_answers: dict[bool, list[tuple[int, str]]] = {loop: [] for loop in (False, True)}
    for loop in (False, True):
        with proxy(coord, redis_url, loop=loop) as (client, _):
            stale = json.loads(submission(coord, late[loop], 0, lease=False).model_dump_json())
            reply = client.post(ROLLOUTS_PATH, json=stale, headers=AUTH)
            late_answers[loop].append((reply.status_code, reply.text.replace(late[loop]["task_id"], "<task>")))
    clock.advance(coord.config.async_.generate_task_timeout_s + 1)
    coord.tick()  # every task in flight timed out: cancelled
    cancelled = next(t for t in coord.dispatcher.generate if t["task_id"] not in submitted)
    for loop in (False, True):
        with proxy(coord, redis_url, loop=loop) as (client, _):
            gone = client.post(ROLLOUTS_PATH, content=submit_body(coord, cancelled, None), headers=AUTH)
            late_answers[loop].append((gone.status_code, gone.json()["error"]))
    assert late_answers[False] == late_answers[True]
    assert [status for status, _ in late_answers[True]] == [409, 410]
    assert coord.status().counters["rollouts_stale"] == 2


def test_a_submit_the_loop_cannot_make_is_made_by_the_route(coord: Coordinator) -> None:
    """Nothing listens on the loop client's port: the route admits it, through the coordinator's own client."""
    start_run(coord)
    task = coord.dispatcher.generate[0]
    lease_id = coord.lease("gen-1", task["task_id"]).lease_id
    with proxy(coord, f"redis://127.0.0.1:{free_port()}/0") as (client, answers):
        answer = client.post(ROLLOUTS_PATH, content=submit_body(coord, task, lease_id), headers=AUTH)
        assert (answer.status_code, answer.json()) == (200, {"status": "admitted"}), answer.text
        assert answers.served[ROLLOUTS_PATH] == 0
    assert coord.status().counters["rollouts_admitted"] == 1


# ---- the long poll ----

LONG_POLL_QUERIES = [
    "",
    "?after=-1",
    "?after=0&wait_s=0",
    "?after=3&wait_s=0.01",
    "?wait_s=0",
    "?after=-2",
    "?after=1.0",
    "?after=%2B1",
    "?after=",
    "?wait_s=31",
    "?wait_s=-1",
    "?wait_s=1e-3",
    "?after=0&after=1",
    "?verbose=1",
]


@pytest.mark.parametrize("query", LONG_POLL_QUERIES)
def test_every_long_poll_is_answered_as_the_route_answers_it(coord: Coordinator, redis_url: str, query: str) -> None:
    start_run(coord)
    answers = []
    for loop in (False, True):
        with proxy(coord, redis_url, loop=loop) as (client, loop_answers):
            answer = client.get(f"{LATEST_PATH}{query}", headers=AUTH)
            answers.append((answer.status_code, answer.json()))
            served = loop_answers.served[LATEST_PATH]
    assert answers[0] == answers[1], query
    plain = answers[1][0] == 200 and query not in ("?after=1.0", "?after=%2B1", "?wait_s=1e-3", "?after=0&after=1")
    assert served == (1 if plain else 0), "answered on the loop only when spelt plainly"
