"""The HTTP API: auth, validation, error codes, metrics; FastAPI's TestClient over a real coordinator."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from redis import Redis

from proxy.api.app import (
    REDIS_CONNECTIONS,
    ROUTE_THREADS,
    ProxyStartupError,
    check_can_serve,
    create_app,
    is_loopback,
    proxy_redis,
    serve,
)
from proxy.api.settings import ProxySettings
from proxy.coordinator.service import Coordinator
from tests.support.fixtures_coordinator import API_TOKEN
from tests.support.fixtures_redis import RedisServer
from tests.support.proxy_harness import (
    ManualClock,
    file_bucket,
    make_coordinator,
    start_run,
    submission,
    write_fake_version,
)

TOKEN = API_TOKEN
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def coord(coord: Coordinator) -> Coordinator:
    """The plugin's fresh coordinator, started: version 0 published and generate tasks dispatched."""
    return start_run(coord)


def state_of(coord: Coordinator) -> dict:
    """Everything a refused request must leave as it was."""
    status = coord.status().model_dump()
    return {
        "status": status,
        "buffer": coord.redis.lrange(coord.keys.buffer, 0, -1),
        "leases": coord.redis.zrange(coord.keys.leases, 0, -1),
        "workers": coord.redis.zrange(coord.keys.workers, 0, -1),
    }


def submit_body(coord: Coordinator, index: int = 0, version: int = 0) -> dict:
    return submission(coord, coord.dispatcher.generate[index], version).model_dump(mode="json")


def publish_body(version: int, sha: str) -> dict:
    return {"version": version, "base_version": version - 1, "step": version, "worker_id": "t1", "manifest_sha256": sha}


def test_happy_path_over_http(http: TestClient, coord: Coordinator) -> None:
    run = http.get("/v1/run", headers=AUTH).json()
    assert run["current_version"] == 0 and run["num_prompts"] == 20 and run["config_key"] == "runs/r1/config.json"
    grant = http.post("/v1/leases", json={"worker_id": "w1", "task_id": "t1"}, headers=AUTH)
    assert grant.status_code == 200 and grant.json()["version"] == 0
    lease_id = grant.json()["lease_id"]
    assert http.post(f"/v1/leases/{lease_id}/renew", json={}, headers=AUTH).status_code == 200
    assert http.post(f"/v1/leases/{lease_id}/renew", headers=AUTH).status_code == 200
    for index in (0, 1):
        answer = http.post("/v1/rollouts", json=submit_body(coord, index), headers=AUTH)
        assert answer.json() == {"status": "admitted"}
    assert http.post("/v1/rollouts", json=submit_body(coord, 0), headers=AUTH).json() == {"status": "duplicate"}
    assert http.delete(f"/v1/leases/{lease_id}", headers=AUTH).json() == {"released": True}
    coord.tick()
    step = http.get("/v1/steps/1", headers=AUTH).json()
    assert step["base_version"] == 0 and len(step["rollouts"]) == 2
    sha = write_fake_version(coord.bucket, coord.run, 1)
    assert http.post("/v1/versions", json=publish_body(1, sha), headers=AUTH).json() == {"current_version": 1}
    beat = {"worker_id": "w1", "role": "generate", "hostname": "h", "pid": 3, "state": "busy"}
    assert http.post("/v1/workers/heartbeat", json=beat, headers=AUTH).status_code == 200
    workers = http.get("/v1/workers", headers=AUTH).json()["workers"]
    assert [w["worker_id"] for w in workers] == ["w1"] and workers[0]["alive"]
    status = http.get("/v1/status", headers=AUTH).json()
    assert status["current_version"] == 1 and status["counters"]["rollouts_admitted"] == 2


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": "Basic x"}]
)
def test_missing_or_wrong_token_is_401_and_changes_nothing(http: TestClient, coord: Coordinator, headers: dict) -> None:
    sha = write_fake_version(coord.bucket, coord.run, 1)
    lease_id = coord.lease("w", "t").lease_id
    rollout = submit_body(coord)  # leases its task
    before = state_of(coord)
    calls = [
        ("POST", "/v1/leases", {"worker_id": "w1", "task_id": "t1"}),
        ("POST", f"/v1/leases/{lease_id}/renew", {}),
        ("DELETE", f"/v1/leases/{lease_id}", None),
        ("POST", "/v1/rollouts", rollout),
        ("POST", "/v1/versions", publish_body(1, sha)),
        (
            "POST",
            "/v1/workers/heartbeat",
            {"worker_id": "w", "role": "generate", "hostname": "h", "pid": 1, "state": "x"},
        ),
        ("POST", "/v1/rollouts", None),  # even a malformed body is refused for its token first
        ("GET", "/v1/status", None),  # reads name tasks, leases, workers, hosts: token holders only
        ("GET", "/v1/workers", None),
        ("GET", "/v1/run", None),
        ("GET", "/v1/steps/0", None),
        ("GET", "/v1/versions/latest", None),
        ("GET", "/no/such/path", None),  # a scanner learns nothing, not even which paths exist
    ]
    for method, path, body in calls:
        answer = http.request(method, path, json=body, headers=headers)
        assert answer.status_code == 401, (method, path, answer.text)
        assert answer.json()["error"] == "unauthorized"
    assert state_of(coord) == before
    assert http.get("/v1/status", headers=AUTH).status_code == 200
    assert http.get("/healthz").status_code == 200 and http.get("/metrics").status_code == 200, "probes stay open"


def test_malformed_body_is_422_and_changes_nothing(http: TestClient, coord: Coordinator) -> None:
    sha = write_fake_version(coord.bucket, coord.run, 1)
    good = submit_body(coord)
    before = state_of(coord)
    bad_requests = [
        ("/v1/rollouts", b"{not json"),
        ("/v1/rollouts", {k: v for k, v in good.items() if k != "version"}),
        ("/v1/rollouts", {**good, "version": "seven"}),
        ("/v1/rollouts", {**good, "unexpected": 1}),
        ("/v1/rollouts", {**good, "sha256": "XYZ"}),
        ("/v1/leases", {"worker_id": "w1"}),
        ("/v1/leases", {"worker_id": "bad id with spaces", "task_id": "t"}),
        ("/v1/versions", {**publish_body(1, sha), "version": -3}),
        ("/v1/workers/heartbeat", {"worker_id": "w", "role": "janitor", "hostname": "h", "pid": 1, "state": "x"}),
    ]
    for path, body in bad_requests:
        if isinstance(body, bytes):
            answer = http.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
        else:
            answer = http.post(path, json=body, headers=AUTH)
        assert answer.status_code == 422, (path, body, answer.text)
        assert answer.json()["error"] == "bad_request" and answer.json()["errors"]
    assert state_of(coord) == before


def test_refusals_have_their_codes(http: TestClient, coord: Coordinator) -> None:
    # 400: groups that are not the task's
    body = submit_body(coord, 0)
    body["group_ids"] = [coord.dispatcher.generate[1]["groups"][0]["group_id"]]
    answer = http.post("/v1/rollouts", json=body, headers=AUTH)
    assert answer.status_code == 400 and "not part of task" in answer.json()["detail"]
    # 410 lease lost
    answer = http.post("/v1/leases/0123abcd/renew", json={}, headers=AUTH)
    assert answer.status_code == 410 and answer.json()["error"] == "lease_lost"
    # 410 cancelled (never dispatched)
    body = submit_body(coord, 0)
    body["task_id"] = "gen-r1-0-77777777"
    body["key"] = "runs/r1/rollouts/gen-r1-0-77777777.safetensors"
    answer = http.post("/v1/rollouts", json=body, headers=AUTH)
    assert answer.status_code == 410 and answer.json()["error"] == "cancelled"
    # 409 conflict with the reason and the current version
    sha = write_fake_version(coord.bucket, coord.run, 1)
    answer = http.post("/v1/versions", json=publish_body(1, sha), headers=AUTH)
    assert answer.status_code == 409
    assert answer.json()["reason"] == "step_not_claimed" and answer.json()["current_version"] == 0
    answer = http.post("/v1/versions", json=publish_body(2, "c" * 64), headers=AUTH)
    assert answer.status_code == 409 and answer.json()["reason"] == "manifest_missing"
    # 404 step
    assert http.get("/v1/steps/42", headers=AUTH).status_code == 404
    assert coord.current_version() == 0


def test_stale_rollout_is_409_with_the_numbers(redis_client: Redis, tmp_path: Path, clock: ManualClock) -> None:
    from tests.support.proxy_harness import advance_version, lease_task

    coord = start_run(make_coordinator(redis_client, file_bucket(tmp_path), clock=clock))
    late = coord.dispatcher.generate[0]
    lease_task(coord, late)  # on v0
    submitted = {late["task_id"]}
    advance_version(coord, submitted)
    advance_version(coord, submitted)
    with TestClient(create_app(coord, TOKEN, run_loop=False)) as http:
        answer = http.post("/v1/rollouts", json=submission(coord, late, 0).model_dump(mode="json"), headers=AUTH)
    assert answer.status_code == 409
    body = answer.json()
    assert body["error"] == "stale" and body["version"] == 0 and body["current_version"] == 2
    assert "async.max_staleness=1" in body["detail"]


def test_lease_before_any_version_is_409_not_ready(redis_client: Redis, tmp_path: Path) -> None:
    coord = make_coordinator(redis_client, file_bucket(tmp_path))
    coord.tick()
    with TestClient(create_app(coord, TOKEN, run_loop=False)) as http:
        answer = http.post("/v1/leases", json={"worker_id": "w", "task_id": "t"}, headers=AUTH)
    assert answer.status_code == 409 and answer.json()["error"] == "not_ready"


def test_metrics_health_and_openapi(http: TestClient, coord: Coordinator) -> None:
    http.post("/v1/rollouts", json=submit_body(coord, 0), headers=AUTH)
    http.post("/v1/rollouts", json=submit_body(coord, 1), headers=AUTH)
    coord.tick()
    assert http.get("/healthz").json()["status"] == "ok"
    text = http.get("/metrics").text
    for line in (
        "asyncgrpo_current_version 0.0",
        "asyncgrpo_rollouts_admitted_total 2.0",
        "asyncgrpo_groups_buffered 0.0",
        "asyncgrpo_leases_expired_total 0.0",
        "asyncgrpo_stale_drops_total 0.0",
        "asyncgrpo_publish_total 1.0",
        "asyncgrpo_sample_staleness_versions_count 4.0",
        'asyncgrpo_workers_alive{role="generate"} 0.0',
        'asyncgrpo_http_request_seconds_count{method="POST",route="/v1/rollouts"} 2.0',
    ):
        assert line in text, line
    schema = http.get("/openapi.json").json()
    assert {"/v1/leases", "/v1/rollouts", "/v1/versions", "/v1/steps/{step}"} <= set(schema["paths"])


def test_housekeeping_loop_runs_in_the_app_lifespan(redis_client: Redis, tmp_path: Path) -> None:
    coord = make_coordinator(redis_client, file_bucket(tmp_path))
    import time

    with TestClient(create_app(coord, TOKEN, tick_s=0.05)) as http:
        deadline = time.monotonic() + 10
        while not coord.dispatcher.optimize and time.monotonic() < deadline:
            time.sleep(0.02)
        assert coord.dispatcher.optimize[0]["step"] == 0, "the loop sent the init step by itself"
        assert http.get("/healthz").status_code == 200


def test_serving_without_token_needs_loopback() -> None:
    check_can_serve("0.0.0.0", "0123456789abcdef" * 4, insecure_loopback=False)
    check_can_serve("127.0.0.1", None, insecure_loopback=True)
    check_can_serve("::1", None, insecure_loopback=True)
    with pytest.raises(ProxyStartupError, match="ASYNCGRPO_TOKEN is not set"):
        check_can_serve("127.0.0.1", None, insecure_loopback=False)
    with pytest.raises(ProxyStartupError, match="only allowed with a loopback"):
        check_can_serve("0.0.0.0", None, insecure_loopback=True)
    assert is_loopback("localhost") and is_loopback("127.0.0.2") and not is_loopback("10.0.0.1")


def test_serve_exits_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCGRPO_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="only allowed with a loopback"):
        serve("r1", "0.0.0.0", 8700, ProxySettings(), insecure_loopback=True)


def test_every_request_gets_one_log_line_with_its_duration(http: TestClient) -> None:
    from structlog.testing import capture_logs

    with capture_logs() as lines:
        http.post("/v1/leases", json={"worker_id": "gen-1", "task_id": "t-1"}, headers=AUTH)
        http.get("/v1/status", headers=AUTH)
    requests = [line for line in lines if line["event"] == "proxy.request"]
    assert [(r["method"], r["route"], r["status"]) for r in requests] == [
        ("POST", "/v1/leases", 200),
        ("GET", "/v1/status", 200),
    ]
    assert requests[0]["log_level"] == "info" and requests[1]["log_level"] == "debug"
    assert all(r["seconds"] > 0 for r in requests)


def test_the_fleets_polls_are_logged_at_debug_unless_refused(http: TestClient) -> None:
    """Every worker sends a heartbeat every few seconds and holds a long poll: at info they would be most of
    the log. A refused one is logged at info, as every other refusal is."""
    from structlog.testing import capture_logs

    beat = {"worker_id": "gen-1", "role": "generate", "hostname": "h", "pid": 1, "state": "idle"}
    with capture_logs() as lines:
        http.post("/v1/workers/heartbeat", json=beat, headers=AUTH)
        http.get("/v1/versions/latest", headers=AUTH)
        http.post("/v1/workers/heartbeat", json={**beat, "role": "judge"}, headers=AUTH)
        http.post(f"/v1/leases/{'f' * 32}/renew", json={}, headers=AUTH)
    requests = [(r["route"], r["status"], r["log_level"]) for r in lines if r["event"] == "proxy.request"]
    assert requests == [
        ("/v1/workers/heartbeat", 200, "debug"),
        ("/v1/versions/latest", 200, "debug"),
        ("/v1/workers/heartbeat", 422, "info"),
        ("/v1/leases/{lease_id}/renew", 410, "info"),
    ]


def test_the_proxy_redis_client_has_a_connection_for_every_route_thread(redis_server: RedisServer) -> None:
    # redis-py's default pool refuses its 101st concurrent call ("Too many connections"), which the proxy
    # answered as `unavailable` once a fleet of workers kept more than 100 handler threads busy.
    client = proxy_redis(redis_server.url)
    pool = client.connection_pool
    assert max(100, ROUTE_THREADS) < REDIS_CONNECTIONS
    held = [pool.get_connection() for _ in range(REDIS_CONNECTIONS - 1)]
    try:
        assert len({id(conn) for conn in held}) == REDIS_CONNECTIONS - 1
        assert client.ping() and client.connection_pool.connection_kwargs["decode_responses"]
    finally:
        for conn in held:
            pool.release(conn)
        pool.disconnect()
