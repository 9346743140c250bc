"""``GET /v1/versions/latest`` and ``ProxyClient.latest_version``: the long poll over a real coordinator, on
TestClient and on a real port: an answer at once when newer, a wake-up on a publish (in-process and from
Redis alone), the current version when the wait runs out, and the project's error body for bad arguments."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.errors import BadRequest
from asyncgrpo.protocol.schemas import LatestVersion
from proxy.api.app import create_app
from proxy.api.version_watch import VersionWatch
from proxy.coordinator.service import Coordinator
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.proxy_harness import (
    ManualClock,
    file_bucket,
    make_coordinator,
    publish_next,
    publish_request,
    start_run,
    submit_pending,
    write_fake_version,
)

URL = "/v1/versions/latest"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


@pytest.fixture
def coord(coord: Coordinator) -> Coordinator:
    """Version 0 published, generate tasks dispatched."""
    return start_run(coord)


def claim_next_step(coord: Coordinator) -> None:
    """Submit every dispatched task at the current version and tick, so step current+1 is claimed."""
    submit_pending(coord, set())
    coord.tick()
    assert coord.status().step_inflight == coord.current_version() + 1


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


class Poll(threading.Thread):
    """One long poll in a thread; ``answer`` and ``seconds`` once it returned."""

    def __init__(self, client: ProxyClient, after: int, wait_s: float) -> None:
        super().__init__(daemon=True)
        self.client, self.after, self.wait_s = client, after, wait_s
        self.answer: LatestVersion | None = None
        self.seconds = 0.0

    def run(self) -> None:
        started = time.monotonic()
        self.answer = self.client.latest_version(after=self.after, wait_s=self.wait_s)
        self.seconds = time.monotonic() - started


@pytest.fixture
def live(coord: Coordinator) -> Iterator[tuple[ProxyClient, VersionWatch]]:
    """The app on a real port (tick loop off), a client, and the app's watch with a fallback too slow to matter."""
    app = create_app(coord, API_TOKEN, run_loop=False)
    watch: VersionWatch = app.state.version_watch
    watch.fallback_s = 120.0  # only a notify can answer in time, unless a test lowers it
    with served(app) as url, ProxyClient(url, API_TOKEN, retries=0) as client:
        try:
            yield client, watch
        finally:
            watch.close()  # no open poll may hold the server's shutdown


def test_answers_at_once_when_a_newer_version_exists(http: TestClient, coord: Coordinator) -> None:
    started = time.monotonic()
    body = http.get(URL, params={"after": -1, "wait_s": 30}, headers=AUTH).json()
    assert time.monotonic() - started < 10
    sha = coord.redis.hget(coord.keys.versions, "0")
    assert body == {
        "run": "r1",
        "version": 0,
        "adapter_prefix": bucket_keys.adapter_prefix("r1", 0),
        "manifest_key": bucket_keys.manifest_key("r1", 0),
        "manifest_sha256": sha,
    }


def test_times_out_with_the_current_version(http: TestClient) -> None:
    started = time.monotonic()
    body = http.get(URL, params={"after": 0, "wait_s": 0.3}, headers=AUTH).json()
    assert time.monotonic() - started >= 0.3
    assert body["version"] == 0 and body["manifest_sha256"]
    assert http.get(URL, params={"after": 5}, headers=AUTH).json()["version"] == 0  # wait_s defaults to 0: answers now


@pytest.mark.parametrize("params", [{"after": -2}, {"wait_s": 31}, {"wait_s": -1}, {"after": "x"}, {"wait_s": "soon"}])
def test_bad_arguments_get_the_error_body(http: TestClient, params: dict) -> None:
    answer = http.get(URL, params=params, headers=AUTH)
    assert answer.status_code == 422
    body = answer.json()
    assert body["error"] == "bad_request" and body["detail"] and body["errors"]


def test_before_version_0_it_answers_minus_one(redis_client: Redis, tmp_path: Path) -> None:
    fresh = make_coordinator(redis_client, file_bucket(tmp_path), clock=ManualClock())
    fresh.ensure_state()
    with TestClient(create_app(fresh, API_TOKEN, run_loop=False)) as http:
        body = http.get(URL, params={"after": -1, "wait_s": 0.05}, headers=AUTH).json()
    assert body["version"] == -1 and body["manifest_sha256"] is None and body["manifest_key"] is None


def test_a_publish_wakes_the_waiters(live: tuple[ProxyClient, VersionWatch], coord: Coordinator) -> None:
    client, watch = live
    polls = [Poll(client, after=0, wait_s=30), Poll(client, after=0, wait_s=30)]
    for poll in polls:
        poll.start()
    wait_until(lambda: watch.waiting == 2)
    claim_next_step(coord)
    sha = write_fake_version(coord.bucket, "r1", 1)
    assert client.publish(publish_request(1, sha)).current_version == 1
    for poll in polls:
        poll.join(timeout=15)
        assert not poll.is_alive(), "the publish did not wake the waiter"
        assert poll.answer is not None and poll.answer.version == 1 and poll.answer.manifest_sha256 == sha
        assert poll.seconds < 15  # woken by the publish, long before its 30 s (and the 120 s fallback)


def test_a_publish_seen_only_in_redis_is_noticed(live: tuple[ProxyClient, VersionWatch], coord: Coordinator) -> None:
    client, watch = live
    watch.fallback_s = 0.05
    poll = Poll(client, after=0, wait_s=30)
    poll.start()
    wait_until(lambda: watch.waiting == 1)
    claim_next_step(coord)
    publish_next(coord)  # straight into Redis, as another proxy process would: no notify
    poll.join(timeout=15)
    assert poll.answer is not None and poll.answer.version == 1


def test_the_waiters_share_their_reads_of_redis(live: tuple[ProxyClient, VersionWatch], coord: Coordinator) -> None:
    client, watch = live
    watch.fallback_s = 0.2
    before = watch.reads
    polls = [Poll(client, after=0, wait_s=2) for _ in range(40)]
    for poll in polls:
        poll.start()
    for poll in polls:
        poll.join(timeout=30)
        assert poll.answer is not None and poll.answer.version == 0, "nothing was published: the wait ran out"
    # 40 waiters for 2 s, each wanting a fresh read every 0.2 s: 400 reads unshared, about 10 shared.
    reads = watch.reads - before
    assert 0 < reads <= 2 / 0.2 + 5, f"{reads} reads of Redis for 40 waiters"
    # A publish still reaches every waiter at once, through one read.
    polls = [Poll(client, after=0, wait_s=30) for _ in range(10)]
    for poll in polls:
        poll.start()
    wait_until(lambda: watch.waiting == 10)
    watch.fallback_s = 120.0
    claim_next_step(coord)
    sha = write_fake_version(coord.bucket, "r1", 1)
    before = watch.reads
    assert client.publish(publish_request(1, sha)).current_version == 1
    for poll in polls:
        poll.join(timeout=15)
        assert poll.answer is not None and poll.answer.version == 1
    assert watch.reads - before <= 2, "the waiters woken by a publish read Redis once, not once each"


def test_a_waiter_sleeps_until_a_publish_or_its_deadline(
    live: tuple[ProxyClient, VersionWatch], coord: Coordinator
) -> None:
    """The watcher re-reads Redis for everyone: a waiter is not woken at each re-read (at 1,000 waiters, 1,000
    timers a second), only when the version moved or its time ran out."""
    client, watch = live
    watch.fallback_s = 0.05
    reads, sleeps = watch.reads, watch.sleeps
    polls = [Poll(client, after=0, wait_s=1) for _ in range(20)]
    for poll in polls:
        poll.start()
    for poll in polls:
        poll.join(timeout=30)
        assert poll.answer is not None and poll.answer.version == 0
    assert watch.reads - reads >= 5, "the watcher kept reading Redis while they waited"
    assert watch.sleeps - sleeps == 20, "each waiter slept once, through every re-read"
    # A publish straight into Redis, as another proxy process would: the watcher's next read wakes them.
    polls = [Poll(client, after=0, wait_s=30) for _ in range(5)]
    for poll in polls:
        poll.start()
    wait_until(lambda: watch.waiting == 5)
    claim_next_step(coord)
    publish_next(coord)
    for poll in polls:
        poll.join(timeout=15)
        assert poll.answer is not None and poll.answer.version == 1 and poll.seconds < 15


def test_closing_answers_open_polls(live: tuple[ProxyClient, VersionWatch]) -> None:
    client, watch = live
    poll = Poll(client, after=0, wait_s=30)
    poll.start()
    wait_until(lambda: watch.waiting == 1)
    watch.close()
    poll.join(timeout=15)
    assert poll.answer is not None and poll.answer.version == 0


def test_the_client_raises_bad_request_for_bad_arguments(live: tuple[ProxyClient, VersionWatch]) -> None:
    client, _ = live
    assert client.latest_version(after=-1).version == 0
    with pytest.raises(BadRequest) as refused:
        client.latest_version(after=-7)
    assert refused.value.status == 422 and refused.value.error == "bad_request"
