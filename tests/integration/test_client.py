"""ProxyClient: bounded retries on transport errors and 502/503/504 only; one exception per refusal,
checked against a real uvicorn server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from asyncgrpo.protocol.client import KEEP_ALIVE_S as CLIENT_KEEP_ALIVE_S
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.errors import (
    BadRequest,
    Cancelled,
    Conflict,
    LeaseLost,
    NotFound,
    NotReady,
    ProxyError,
    ProxyUnavailable,
    StaleRollout,
    Unauthorized,
)
from asyncgrpo.protocol.schemas import HeartbeatRequest, LeaseRequest, PublishRequest, RolloutSubmission
from proxy.api.app import KEEP_ALIVE_S as PROXY_KEEP_ALIVE_S
from proxy.api.app import create_app
from proxy.coordinator.service import Coordinator
from tests.support.fixtures_coordinator import served
from tests.support.fixtures_redis import free_port
from tests.support.proxy_harness import (
    advance_version,
    lease_task,
    publish_next,
    publish_request,
    submission,
    write_fake_version,
)
from worker.process.settings import WorkerSettings

TOKEN = "client-test-token"


@pytest.fixture
def proxy_url(coord: Coordinator) -> Iterator[str]:
    with served(create_app(coord, TOKEN, run_loop=False)) as url:
        yield url


def client_for(url: str, token: str | None = TOKEN) -> ProxyClient:
    return ProxyClient(url, token, timeout_s=5, retries=1, sleep=lambda _: None)


LEASE = LeaseRequest(worker_id="gen-1", task_id="t1")


def test_each_refusal_maps_to_its_exception(proxy_url: str, coord: Coordinator) -> None:
    client = client_for(proxy_url)
    coord.tick()
    with pytest.raises(NotReady):
        client.lease(LEASE)
    publish_next(coord)
    coord.tick()
    info = client.run_info()
    assert info.current_version == 0 and info.run == "r1"
    grant = client.lease(LEASE)
    assert client.renew(grant.lease_id).version == 0
    assert client.release(grant.lease_id).released is True
    with pytest.raises(LeaseLost):
        client.renew(grant.lease_id)
    with pytest.raises(Unauthorized):
        client_for(proxy_url, token="nope").lease(LEASE)
    with pytest.raises(Unauthorized):
        client_for(proxy_url, token=None).release(grant.lease_id)

    late = coord.dispatcher.generate[0]
    lease_task(coord, late)  # on v0
    submitted = {late["task_id"]}
    advance_version(coord, submitted)
    advance_version(coord, submitted)
    stale = submission(coord, late, 0)
    with pytest.raises(StaleRollout) as caught:
        client.submit_rollout(stale)
    assert caught.value.status == 409 and caught.value.body["current_version"] == 2
    with pytest.raises(Cancelled):
        client.submit_rollout(
            stale.model_copy(
                update={"task_id": "gen-r1-0-55555555", "key": "runs/r1/rollouts/gen-r1-0-55555555.safetensors"}
            )
        )
    pending = next(t for t in coord.dispatcher.generate if t["task_id"] not in submitted)
    good = submission(coord, pending, 2)
    with pytest.raises(BadRequest, match="not part of task"):
        client.submit_rollout(good.model_copy(update={"group_ids": ["gen-r1-0-00000001.0"]}))
    # A body that skipped validation on this side is refused by the proxy's schema (422), the same exception.
    unchecked = RolloutSubmission.model_construct(**{**good.model_dump(), "sha256": "not-hex"})
    with pytest.raises(BadRequest, match="does not match the schema") as invalid:
        client.submit_rollout(unchecked)
    assert invalid.value.status == 422 and invalid.value.error == "bad_request"
    assert client.submit_rollout(good).status == "admitted"
    assert client.submit_rollout(good).status == "duplicate"

    sha = write_fake_version(coord.bucket, "r1", 3)
    with pytest.raises(Conflict) as conflict:
        client.publish(publish_request(3, sha, worker_id="trainer-9"))
    assert conflict.value.body["reason"] == "step_not_claimed"
    with pytest.raises(NotFound):
        client.get_step(99)
    assert client.get_step(2).base_version == 1

    assert client.heartbeat(
        HeartbeatRequest(worker_id="gen-1", role="generate", hostname="h", pid=1, state="idle", versions_cached=[2])
    ).ok
    assert [w.worker_id for w in client.workers()] == ["gen-1"]
    assert client.status().current_version == 2
    for kind in (StaleRollout, Conflict, LeaseLost, Unauthorized, Cancelled, NotReady, BadRequest, NotFound):
        assert issubclass(kind, ProxyError)


def _counting_client(handler, retries: int = 3) -> tuple[ProxyClient, list[float]]:
    sleeps: list[float] = []
    client = ProxyClient(
        "http://proxy.invalid", TOKEN, retries=retries, transport=httpx.MockTransport(handler), sleep=sleeps.append
    )
    return client, sleeps


def test_transport_errors_are_retried_a_bounded_number_of_times() -> None:
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("connection refused", request=request)

    client, sleeps = _counting_client(handler, retries=3)
    with pytest.raises(ProxyUnavailable, match="after 4 attempts"):
        client.status()
    assert len(calls) == 4 and len(sleeps) == 3
    assert all(0 < s <= client.max_backoff_s for s in sleeps)
    assert calls[0].headers["authorization"] == f"Bearer {TOKEN}"


def test_busy_proxy_is_retried_then_succeeds() -> None:
    answers = iter([503, 502, 200])
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        code = next(answers)
        if code != 200:
            return httpx.Response(code, json={"error": "unavailable", "detail": "rebuilding"})
        return httpx.Response(200, json={"status": "admitted"})

    client, sleeps = _counting_client(handler)
    result = client.submit_rollout(
        RolloutSubmission(
            task_id="t1", worker_id="w", version=0, key="k", sha256="a" * 64, group_ids=["t1.0"], num_samples=2
        )
    )
    assert result.status == "admitted" and len(calls) == 3 and len(sleeps) == 2


@pytest.mark.parametrize("code", [409, 410, 401, 422, 500])
def test_refusals_are_not_retried(code: int) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(code, json={"error": "conflict", "detail": "no"})

    client, sleeps = _counting_client(handler)
    with pytest.raises(ProxyError) as caught:
        client.publish(PublishRequest(version=1, base_version=0, step=1, worker_id="w", manifest_sha256="a" * 64))
    assert len(calls) == 1 and sleeps == [] and caught.value.status == code


def test_unreachable_proxy_gives_up(tmp_path: Path) -> None:
    client = ProxyClient(f"http://127.0.0.1:{free_port()}", TOKEN, timeout_s=1, retries=2, sleep=lambda _: None)
    with pytest.raises(ProxyUnavailable, match="after 3 attempts"):
        client.run_info()


def test_idle_connections_outlive_the_heartbeat_interval() -> None:
    # A heartbeat every heartbeat_s reuses its connection only if the client keeps it that long, and the proxy
    # longer still (the client must be the side that closes an idle connection, or a reuse can meet a reset).
    assert WorkerSettings.model_fields["heartbeat_s"].default < CLIENT_KEEP_ALIVE_S < PROXY_KEEP_ALIVE_S
