"""Heartbeats answered on the event loop (``proxy.api.loop_routes``), on a real port with a real Redis: recorded
exactly as the route records them, and every request off that path answered by the route, alike."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from proxy.api.app import create_app
from proxy.coordinator.service import Coordinator
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.fixtures_redis import free_port
from tests.support.proxy_harness import start_run

AUTH = {"Authorization": f"Bearer {API_TOKEN}", "Content-Type": "application/json"}
BEAT = {"worker_id": "gen-1", "role": "generate", "hostname": "h", "pid": 7, "state": "idle", "incarnation": "a1"}


@contextmanager
def proxy(coord: Coordinator, redis_url: str | None) -> Iterator[tuple[httpx.Client, object]]:
    app = create_app(coord, API_TOKEN, run_loop=False, redis_url=redis_url)
    with served(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client, app.state.heartbeats


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
        assert heartbeats.served == 1  # type: ignore[attr-defined]
        (record,) = coord.workers()
        assert (record.worker_id, record.pid, record.incarnation, record.alive) == ("gen-1", 7, "a1", True)
        # a new incarnation under the same id is a restart, as through the route
        client.post("/v1/workers/heartbeat", json={**BEAT, "incarnation": "b2"}, headers=AUTH)
        assert coord.workers()[0].restarts == 1
    samples = {
        sample.labels["route"]
        for metric in coord.metrics.registry.collect()
        if metric.name == "asyncgrpo_http_request_seconds"
        for sample in metric.samples
        if sample.name.endswith("_count")
    }
    assert "/v1/workers/heartbeat" in samples, "timed under the route's label, as the route's answers are"


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
    assert heartbeats.served == (1 if what == "valid" else 0)  # type: ignore[attr-defined]


def test_a_heartbeat_the_loop_cannot_record_is_recorded_by_the_route(coord: Coordinator) -> None:
    """Its asyncio client cannot reach Redis (here: nothing listens on its port): the route answers, through
    the coordinator's own client, and nothing is lost."""
    start_run(coord)
    with proxy(coord, f"redis://127.0.0.1:{free_port()}/0") as (client, heartbeats):
        answer = client.post("/v1/workers/heartbeat", json=BEAT, headers=AUTH)
        assert (answer.status_code, answer.json()) == (200, {"ok": True})
        assert heartbeats.served == 0  # type: ignore[attr-defined]
    assert [record.worker_id for record in coord.workers()] == ["gen-1"]
