"""Hostile and malformed requests to a real proxy on a real port (uvicorn, real Redis): each is a 4xx with the
documented ``{"error", "detail"}`` body, small, never a 5xx, and changes nothing in Redis. Also: the exact
token compare, the start-up token policy, reads behind the token, bounded metric labels and worker records."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from redis import Redis

from proxy.api.app import PLACEHOLDER_TOKENS, ProxyStartupError, check_can_serve, create_app, serve
from proxy.api.edge import OPEN_PATHS
from proxy.api.settings import DEFAULT_MAX_BODY_BYTES, ProxySettings
from proxy.coordinator.service import Coordinator
from proxy.coordinator.workers import WORKER_FORGET_S
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.paths import REPO_ROOT
from tests.support.proxy_harness import start_run

ROOT = REPO_ROOT
AUTH = {"Authorization": f"Bearer {API_TOKEN}", "Content-Type": "application/json"}
MAX_ERROR_BYTES = 8 * 1024
"""No error answer is bigger than this, whatever the request held."""
SHA = "0" * 64


@pytest.fixture(params=["routes", "the loop's answers"])
def api(
    coord: Coordinator, redis_url: str, request: pytest.FixtureRequest
) -> Iterator[tuple[httpx.Client, Coordinator]]:
    """The proxy on a real port; also with the fleet's requests answered on the event loop (``proxy.api.loop_routes``),
    which must refuse every hostile request as the routes do."""
    start_run(coord)
    app = create_app(coord, API_TOKEN, run_loop=False, redis_url=redis_url if request.param != "routes" else None)
    with served(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client, coord


def redis_state(redis: Redis) -> dict[str, bytes | None]:
    """Every key of the run's database with its serialized value: what a refused request must leave alone."""
    raw = Redis(connection_pool=redis.connection_pool)
    return {key: raw.dump(key) for key in sorted(raw.keys("*"))}


def task_of(coord: Coordinator) -> dict:
    return coord.dispatcher.generate[0]


def rollout(coord: Coordinator, **fields: object) -> dict:
    task = task_of(coord)
    body = {
        "task_id": task["task_id"],
        "worker_id": "gen-1",
        "version": 0,
        "key": f"runs/{coord.run}/rollouts/{task['task_id']}.bin",
        "sha256": SHA,
        "group_ids": [group["group_id"] for group in task["groups"]],
        "num_samples": 4,
    }
    return {**body, **fields}


BEAT = {"worker_id": "gen-1", "role": "generate", "hostname": "h", "pid": 1, "state": "idle"}
PUBLISH = {"version": 1, "base_version": 0, "step": 1, "worker_id": "opt-1", "manifest_sha256": SHA}


def raw_json(body: dict, **replace: str) -> bytes:
    """``body`` as JSON with some values replaced by raw JSON text (``NaN``, ``1e999``, ``"\\ud800"``)."""
    text = json.dumps({**body, **{name: f"@@{name}@@" for name in replace}})
    for name, raw in replace.items():
        text = text.replace(f'"@@{name}@@"', raw)
    return text.encode()


def hostile_requests(coord: Coordinator) -> list[tuple[str, str, str, bytes, int, str]]:
    """(what, method, path, body, status, error code) for each case of the issue."""
    lease = {"worker_id": "w", "task_id": task_of(coord)["task_id"]}
    return [
        ("lone surrogate id", "POST", "/v1/leases", raw_json(lease, worker_id='"\\ud800"'), 422, "bad_request"),
        ("infinite version", "POST", "/v1/rollouts", raw_json(rollout(coord), version="1e999"), 422, "bad_request"),
        ("NaN version", "POST", "/v1/rollouts", raw_json(rollout(coord), version="NaN"), 422, "bad_request"),
        ("NaN publish", "POST", "/v1/versions", raw_json(PUBLISH, version="NaN"), 422, "bad_request"),
        ("infinite publish", "POST", "/v1/versions", raw_json(PUBLISH, version="1e999"), 422, "bad_request"),
        ("surrogate host", "POST", "/v1/workers/heartbeat", raw_json(BEAT, hostname='"\\ud800"'), 422, "bad_request"),
        ("NaN pid", "POST", "/v1/workers/heartbeat", raw_json(BEAT, pid="NaN"), 422, "bad_request"),
        (
            "surrogate task",
            "POST",
            "/v1/workers/heartbeat",
            raw_json(BEAT, current_task='"\\ud800"'),
            422,
            "bad_request",
        ),
        # A real in-flight task: this one used to reach the Lua script, whose JSON decoder refused it (503).
        (
            "surrogate group",
            "POST",
            "/v1/rollouts",
            raw_json(rollout(coord), group_ids='["\\ud800"]'),
            422,
            "bad_request",
        ),
        ("false for a number", "POST", "/v1/versions", raw_json(PUBLISH, version="false"), 422, "bad_request"),
        ("huge number", "POST", "/v1/versions", raw_json(PUBLISH, version="9" * 5000), 400, "bad_request"),
        ("invalid UTF-8", "POST", "/v1/leases", b'{"worker_id": "\xff\xfe", "task_id": "t"}', 400, "bad_request"),
        ("deep JSON", "POST", "/v1/workers/heartbeat", b"[" * 50_000 + b"]" * 50_000, 400, "bad_request"),
        (
            "too many groups",
            "POST",
            "/v1/rollouts",
            json.dumps(rollout(coord, group_ids=["g"] * 5000)).encode(),
            422,
            "bad_request",
        ),
        (
            "too many stats",
            "POST",
            "/v1/rollouts",
            json.dumps(rollout(coord, stats={f"s{i}": i for i in range(100)})).encode(),
            422,
            "bad_request",
        ),
        (
            "huge info",
            "POST",
            "/v1/workers/heartbeat",
            json.dumps({**BEAT, "info": {"x": "y" * 20_000}}).encode(),
            422,
            "bad_request",
        ),
        (
            "version past the bound",
            "POST",
            "/v1/versions",
            json.dumps({**PUBLISH, "version": 2**53}).encode(),
            422,
            "bad_request",
        ),
        ("unknown path", "POST", "/v1/nothing", b"{}", 404, "not_found"),
        ("wrong method", "PUT", "/v1/leases", b"{}", 405, "method_not_allowed"),
    ]


def assert_error_body(answer: httpx.Response, status: int, code: str) -> dict:
    assert answer.status_code == status, answer.text[:500]
    assert answer.headers["content-type"] == "application/json"
    assert len(answer.content) <= MAX_ERROR_BYTES, f"{len(answer.content)} bytes of error"
    body = answer.json()
    assert body["error"] == code and isinstance(body["detail"], str) and body["detail"], body
    return body


def test_hostile_requests_are_4xx_error_bodies_and_change_nothing(api: tuple[httpx.Client, Coordinator]) -> None:
    client, coord = api
    before = redis_state(coord.redis)
    for what, method, path, body, status, code in hostile_requests(coord):
        answer = client.request(method, path, content=body, headers=AUTH)
        error = assert_error_body(answer, status, code)
        if status == 422:
            assert error["errors"] and all({"loc", "msg", "type"} == set(item) for item in error["errors"]), what
        if what == "wrong method":
            assert "POST" in answer.headers["allow"]
    assert redis_state(coord.redis) == before


def test_error_bodies_never_echo_the_request(api: tuple[httpx.Client, Coordinator]) -> None:
    client, coord = api
    marker = "Q" * (3 * 1024 * 1024)  # under the default body limit: parsed, refused, not sent back
    before = redis_state(coord.redis)
    answer = client.post("/v1/workers/heartbeat", json={**BEAT, "hostname": marker}, headers=AUTH)
    assert "QQQQ" not in assert_error_body(answer, 422, "bad_request")["detail"] and "QQQQ" not in answer.text
    answer = client.post("/v1/workers/heartbeat", json={**BEAT, "info": {"Z" * 10_000: 1}}, headers=AUTH)
    assert "Z" * 100 not in answer.text and len(answer.content) <= MAX_ERROR_BYTES
    assert redis_state(coord.redis) == before


def test_bodies_over_the_default_limit_are_refused_before_parsing(api: tuple[httpx.Client, Coordinator]) -> None:
    client, coord = api
    before = redis_state(coord.redis)
    big = b"x" * (50 * 1024 * 1024)
    assert_error_body(client.post("/v1/rollouts", content=big, headers=AUTH), 413, "too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted as the body arrives
        for _ in range(DEFAULT_MAX_BODY_BYTES // 65536 + 2):
            yield b"y" * 65536

    assert_error_body(client.post("/v1/rollouts", content=chunks(), headers=AUTH), 413, "too_large")
    assert redis_state(coord.redis) == before
    assert DEFAULT_MAX_BODY_BYTES == 4 * 1024 * 1024 and ProxySettings().max_body_bytes == DEFAULT_MAX_BODY_BYTES


def test_the_body_limit_is_configurable(coord: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCGRPO_MAX_BODY_BYTES", "100000")
    limit = ProxySettings().max_body_bytes
    start_run(coord)
    with TestClient(create_app(coord, API_TOKEN, run_loop=False, max_body_bytes=limit)) as http:
        answer = http.post("/v1/workers/heartbeat", content=b" " * 100_001, headers=AUTH)
        assert answer.status_code == 413 and "100000 bytes (ASYNCGRPO_MAX_BODY_BYTES)" in answer.json()["detail"]
        assert http.post("/v1/workers/heartbeat", json=BEAT, headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    "authorization",
    [
        f"Bearer {API_TOKEN}".encode() + "\u00a0".encode(),  # a no-break space after the token (UTF-8)
        f"Bearer {API_TOKEN}".encode() + b"\xa0",  # the same in Latin-1
        f"Bearer {API_TOKEN}x".encode(),
        f"Bearer {API_TOKEN[:-1]}".encode(),
        f"Bearer {API_TOKEN.upper()}".encode(),
        f"Basic {API_TOKEN}".encode(),
        API_TOKEN.encode(),
    ],
)
def test_only_the_exact_token_is_accepted(api: tuple[httpx.Client, Coordinator], authorization: bytes) -> None:
    client, coord = api
    lease_id = coord.lease("gen-1", task_of(coord)["task_id"]).lease_id
    before = redis_state(coord.redis)
    headers = {"Authorization": authorization, "Content-Type": "application/json"}
    for method, path, body in [
        ("POST", "/v1/leases", {"worker_id": "w", "task_id": task_of(coord)["task_id"]}),
        ("POST", "/v1/rollouts", rollout(coord)),
        ("DELETE", f"/v1/leases/{lease_id}", None),
        ("GET", "/v1/status", None),
        ("GET", "/v1/workers", None),
    ]:
        answer = client.request(method, path, content=json.dumps(body).encode() if body else None, headers=headers)
        assert_error_body(answer, 401, "unauthorized")
        assert answer.headers["www-authenticate"] == "Bearer"
    assert redis_state(coord.redis) == before


@pytest.mark.parametrize("authorization", [f"Bearer {API_TOKEN}", f"bearer {API_TOKEN}", f"Bearer   {API_TOKEN}"])
def test_the_token_passes_with_what_http_allows_around_it(
    api: tuple[httpx.Client, Coordinator], authorization: str
) -> None:
    client, _ = api
    assert client.get("/v1/status", headers={"Authorization": authorization}).status_code == 200


def test_reads_need_the_token_and_probes_do_not(api: tuple[httpx.Client, Coordinator]) -> None:
    client, _ = api
    for path in ("/v1/status", "/v1/workers", "/v1/run", "/v1/steps/0", "/v1/versions/0", "/v1/versions/latest"):
        assert_error_body(client.get(path), 401, "unauthorized")
    for path in ("/healthz", "/metrics", "/openapi.json"):
        assert client.get(path).status_code == 200, path
    assert_error_body(client.get("/v1/nowhere", headers=AUTH), 404, "not_found")


def test_metrics_carry_no_ids_and_can_require_the_token(coord: Coordinator) -> None:
    start_run(coord)
    task_id = task_of(coord)["task_id"]
    with TestClient(create_app(coord, API_TOKEN, run_loop=False)) as http:
        lease_id = http.post("/v1/leases", json={"worker_id": "gen-secret-7", "task_id": task_id}, headers=AUTH).json()
        beat = {**BEAT, "worker_id": "gen-secret-7", "hostname": "host-secret-9", "current_task": task_id}
        assert http.post("/v1/workers/heartbeat", json=beat, headers=AUTH).status_code == 200
        text = http.get("/metrics").text
    for secret in ("gen-secret-7", "host-secret-9", task_id, lease_id["lease_id"]):
        assert secret not in text, secret
    with TestClient(create_app(coord, API_TOKEN, run_loop=False, metrics_need_token=True)) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers=AUTH).status_code == 200
        assert http.get("/healthz").status_code == 200


def test_made_up_methods_do_not_grow_the_label_set(coord: Coordinator) -> None:
    start_run(coord)
    with TestClient(create_app(coord, API_TOKEN, run_loop=False)) as http:
        assert http.get("/v1/status", headers=AUTH).status_code == 200
        for index in range(20):
            http.request(f"MADEUP{index}", "/v1/status", headers=AUTH)
            http.request(f"MADEUP{index}", f"/v1/random/{index}")
        text = http.get("/metrics").text
    methods = set(re.findall(r'asyncgrpo_http_request_seconds_count\{method="([^"]+)"', text))
    routes = set(re.findall(r'asyncgrpo_http_request_seconds_count\{method="[^"]+",route="([^"]+)"', text))
    assert methods == {"other", "GET"}, methods
    assert not any(route.startswith("/v1/random") for route in routes), routes


def test_worker_records_expire_when_the_list_forgets_them(api: tuple[httpx.Client, Coordinator]) -> None:
    client, coord = api
    assert client.post("/v1/workers/heartbeat", json={**BEAT, "worker_id": "once-1"}, headers=AUTH).status_code == 200
    ttl = coord.redis.ttl(coord.keys.worker("once-1"))
    assert 0 < ttl <= WORKER_FORGET_S, f"a worker heard from once is kept for {ttl} s"


def test_openapi_declares_the_bearer_scheme_and_every_error_body(api: tuple[httpx.Client, Coordinator]) -> None:
    client, _ = api
    schema = client.get("/openapi.json").json()
    scheme = schema["components"]["securitySchemes"]["bearerToken"]
    assert scheme == {**scheme, "type": "http", "scheme": "bearer"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            refs = {status: json.dumps(answer) for status, answer in responses.items() if status[0] in "45"}
            assert {"500", "503"} <= set(refs), (method, path)
            assert all("ErrorBody" in ref for ref in refs.values()), (method, path)
            if path not in OPEN_PATHS:
                assert operation["security"] == [{"bearerToken": []}], (method, path)
                assert "401" in refs, (method, path)
            if "requestBody" in operation:
                assert {"400", "413", "422"} <= set(refs), (method, path)
            if "422" in refs:
                assert "ValidationErrorBody" in refs["422"], (method, path)
    assert {"409", "410"} <= set(schema["paths"]["/v1/rollouts"]["post"]["responses"])


def placeholder_of_the_shipped_env_file() -> str:
    text = (ROOT / "deploy" / "asyncgrpo.env.example").read_text()
    return re.search(r"^ASYNCGRPO_TOKEN=(.*)$", text, re.M).group(1)


def test_unusable_tokens_are_refused_at_start_up() -> None:
    assert placeholder_of_the_shipped_env_file() in PLACEHOLDER_TOKENS
    good = "3f9a0c1b7d2e4f6a8b0c2d4e6f8a0b1c"
    check_can_serve("0.0.0.0", good, insecure_loopback=False)
    check_can_serve("127.0.0.1", "short-local", insecure_loopback=False)  # loopback: tests and the demo
    refusals = {
        "   ": "blank",
        "": "blank",
        placeholder_of_the_shipped_env_file(): "placeholder",
        "changeme-changeme-changeme-changeme": "placeholder",
        "tok": "at least 32",
        "a" * 40: "too few characters",
        good + " ": "cannot send exactly",
        good + "\u00a0": "cannot send exactly",
    }
    for token, reason in refusals.items():
        with pytest.raises(ProxyStartupError, match=reason) as refused:
            check_can_serve("0.0.0.0", token, insecure_loopback=False)
        assert "openssl rand -hex 32" in str(refused.value)
    with pytest.raises(ProxyStartupError, match="blank"):
        check_can_serve("127.0.0.1", "  ", insecure_loopback=True)


@pytest.mark.parametrize("token", ["   ", "change-me-to-a-long-random-string", "short"])
def test_serve_exits_on_an_unusable_token_from_the_environment(monkeypatch: pytest.MonkeyPatch, token: str) -> None:
    monkeypatch.setenv("ASYNCGRPO_TOKEN", token)
    monkeypatch.setenv("ASYNCGRPO_BUCKET", "file:///nonexistent")
    with pytest.raises(SystemExit, match=r"asyncgrpo proxy: ASYNCGRPO_TOKEN .*openssl rand -hex 32"):
        serve("r1", "0.0.0.0", 8700, ProxySettings())  # as the entry (proxy.__main__) parses them
