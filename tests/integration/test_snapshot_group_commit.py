"""Group commit of the proxy snapshot: one put covers every admission that arrived while the previous was written.

Real Redis and a real FileBucket; only the snapshot put is wrapped (slowed down, or made to fail) so that
submits overlap it. Each submit checks, right after it returned, that its rollout is in the snapshot the
bucket holds then: "admitted" still means durable.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError
from proxy.api.app import create_app
from proxy.coordinator.scripts import SnapshotFailed
from proxy.coordinator.service import Coordinator
from proxy.coordinator.snapshot import load_snapshot
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.proxy_harness import (
    ManualClock,
    file_bucket,
    make_coordinator,
    publish_next,
    small_config,
    submission,
)

SUBMITS = 32
JSON_AUTH = {"Authorization": f"Bearer {API_TOKEN}", "Content-Type": "application/json"}


class SnapshotPuts:
    """A real bucket whose snapshot and log puts can be slowed, held on an event, or made to fail; counts them."""

    def __init__(self, inner: Bucket, run: str) -> None:
        self.inner = inner
        self.key = bucket_keys.proxy_snapshot_key(run)
        self.log = bucket_keys.proxy_log_prefix(run)
        self.delay_s = 0.0
        self.fail = False
        self.hold: threading.Event | None = None
        self.entered = threading.Event()
        self.puts = 0
        self._lock = threading.Lock()

    def put_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        if key != self.key and not key.startswith(self.log):
            return self.inner.put_if_match(key, data, etag)
        with self._lock:
            self.puts += 1
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(timeout=30)
        time.sleep(self.delay_s)
        if self.fail:
            raise BucketError("injected: the bucket refused the snapshot")
        return self.inner.put_if_match(key, data, etag)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def buffered_task_ids(bucket: Bucket, run: str) -> set[str]:
    document = load_snapshot(bucket, run)
    return set() if document is None else {item["task_id"] for item in document["buffer"]}


@pytest.fixture
def busy(redis_client: Redis, tmp_path: Path) -> tuple[Coordinator, SnapshotPuts]:
    """Version 0 published and SUBMITS one-group tasks in flight; the snapshot puts go through SnapshotPuts."""
    config = small_config(groups_per_task=1, groups_per_step=SUBMITS, queue_maxsize=SUBMITS)
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=config, num_prompts=100, clock=ManualClock())
    coord.tick()
    assert publish_next(coord) == 0
    coord.tick()
    assert len(coord.dispatcher.generate) == SUBMITS
    puts = SnapshotPuts(coord.bucket, coord.run)
    coord.snapshots.bucket = puts  # type: ignore[assignment]
    return coord, puts


def submit_all_at_once(coord: Coordinator, puts: SnapshotPuts) -> tuple[list[str], list[str], list[str]]:
    """Submit every in-flight task from its own thread; returns (admitted, durable on return, failed)."""
    barrier = threading.Barrier(SUBMITS)
    admitted: list[str] = []
    durable: list[str] = []
    failed: list[str] = []

    def one(task: dict) -> None:
        barrier.wait()
        try:
            result = coord.submit(submission(coord, task, 0))
        except SnapshotFailed:
            failed.append(task["task_id"])
            return
        assert result.status == "admitted"
        admitted.append(task["task_id"])
        # Right after the answer: the bucket must already hold this rollout as buffered.
        if task["task_id"] in buffered_task_ids(puts.inner, coord.run):
            durable.append(task["task_id"])

    threads = [threading.Thread(target=one, args=(task,)) for task in coord.dispatcher.generate]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return admitted, durable, failed


def test_concurrent_submits_share_snapshot_writes_and_each_is_durable_on_return(
    busy: tuple[Coordinator, SnapshotPuts],
) -> None:
    coord, puts = busy
    puts.delay_s = 0.05
    writes_before = coord.snapshots.writes
    admitted, durable, failed = submit_all_at_once(coord, puts)
    assert not failed
    assert len(admitted) == SUBMITS
    assert sorted(durable) == sorted(admitted)
    # Serialised writes would take one put per submit; group commit needs a handful.
    assert puts.puts <= SUBMITS // 4, f"{puts.puts} snapshot puts for {SUBMITS} submits"
    assert coord.snapshots.writes - writes_before == puts.puts


def test_a_failed_put_fails_every_submit_it_covers(busy: tuple[Coordinator, SnapshotPuts]) -> None:
    coord, puts = busy
    puts.delay_s = 0.05
    puts.fail = True
    admitted, _, failed = submit_all_at_once(coord, puts)
    assert admitted == []
    assert len(failed) == SUBMITS
    assert buffered_task_ids(puts.inner, coord.run) == set()
    assert puts.puts < SUBMITS


def test_a_waiter_covered_by_a_running_write_shares_its_outcome(busy: tuple[Coordinator, SnapshotPuts]) -> None:
    coord, puts = busy
    writer = coord.snapshots
    for fail in (True, False):
        first, second = coord.store.mark_changed(), coord.store.mark_changed()
        puts.hold, puts.fail = threading.Event(), fail
        puts.entered.clear()
        outcomes: dict[str, object] = {}

        def wait_for(name: str, change: int, outcomes: dict[str, object] = outcomes) -> None:
            try:
                outcomes[name] = writer.write_through(change)
            except SnapshotFailed as error:
                outcomes[name] = error

        before = writer.writes
        leader = threading.Thread(target=wait_for, args=("leader", first))
        leader.start()
        assert puts.entered.wait(timeout=10)
        # The running write read the counter after `second` was marked: it covers it, so no second put.
        follower = threading.Thread(target=wait_for, args=("follower", second))
        follower.start()
        time.sleep(0.1)
        assert follower.is_alive()
        puts.hold.set()
        leader.join(timeout=10)
        follower.join(timeout=10)
        assert writer.writes == before + 1
        if fail:
            assert isinstance(outcomes["leader"], SnapshotFailed)
            assert isinstance(outcomes["follower"], SnapshotFailed)
        else:
            assert outcomes == {"leader": True, "follower": False}
    puts.hold = None


def test_a_failed_put_is_answered_unavailable_over_http(busy: tuple[Coordinator, SnapshotPuts]) -> None:
    coord, puts = busy
    puts.fail = True
    task = coord.dispatcher.generate[0]
    with TestClient(create_app(coord, API_TOKEN, run_loop=False)) as client:
        reply = client.post(
            "/v1/rollouts",
            content=submission(coord, task, 0).model_dump_json(),
            headers={"Authorization": f"Bearer {API_TOKEN}", "Content-Type": "application/json"},
        )
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"] == "unavailable"
        puts.fail = False
        # The worker retries: the rollout is answered (as a duplicate) only once it is durable.
        reply = client.post(
            "/v1/rollouts",
            content=submission(coord, task, 0).model_dump_json(),
            headers={"Authorization": f"Bearer {API_TOKEN}", "Content-Type": "application/json"},
        )
        assert reply.status_code == 200, reply.text
    assert task["task_id"] in buffered_task_ids(puts.inner, coord.run)


def test_a_lone_submit_writes_before_it_returns(busy: tuple[Coordinator, SnapshotPuts]) -> None:
    coord, puts = busy
    task = coord.dispatcher.generate[0]
    assert task["task_id"] not in buffered_task_ids(puts.inner, coord.run)
    before = puts.puts
    assert coord.submit(submission(coord, task, 0)).status == "admitted"
    assert puts.puts == before + 1
    assert task["task_id"] in buffered_task_ids(puts.inner, coord.run)


# ---- callers on an event loop (the fleet's submits, proxy.coordinator.fleet) ----


def test_waiters_on_a_loop_share_puts_with_threads_and_each_outcome_is_theirs(
    busy: tuple[Coordinator, SnapshotPuts],
) -> None:
    """A write running in a thread covers the loop's waiters that came before it read the counter; the pump
    writes for the later ones. A failed put fails exactly the waiters it covered."""
    coord, puts = busy
    writer = coord.snapshots
    puts.hold = threading.Event()
    puts.entered.clear()
    covered = coord.store.mark_changed()
    leader_outcome: list[object] = []

    def lead() -> None:
        try:
            leader_outcome.append(writer.write_through(covered))
        except SnapshotFailed as error:
            leader_outcome.append(error)

    leader = threading.Thread(target=lead)
    leader.start()
    assert puts.entered.wait(timeout=10)  # the thread's write read the counter: `covered` is in it

    async def waiters() -> list[object]:
        async def one(change: int) -> object:
            try:
                await writer.wait_durable(change)
            except SnapshotFailed as error:
                return error
            return "durable"

        early = asyncio.ensure_future(one(covered))
        await asyncio.sleep(0.05)
        assert not early.done(), "it waits for the running write"
        late = asyncio.ensure_future(one(coord.store.mark_changed()))  # after that write read the counter
        await asyncio.sleep(0.05)
        puts.fail = True
        puts.hold.set()  # type: ignore[union-attr]
        first = await early
        puts.fail = False
        return [first, await late]

    before = writer.writes
    first, second = asyncio.run(waiters())
    leader.join(timeout=10)
    assert isinstance(first, SnapshotFailed), "the failed put covered it"
    assert leader_outcome == [first], "the thread that wrote it got the same error"
    assert second == "durable", "the pump wrote again for the waiter that came after the failed put read"
    assert writer.writes == before + 1
    puts.hold = None


def test_concurrent_submits_on_the_loop_share_puts_and_each_is_durable_on_return(
    busy: tuple[Coordinator, SnapshotPuts], redis_url: str
) -> None:
    coord, puts = busy
    puts.delay_s = 0.05
    tasks = list(coord.dispatcher.generate)
    bodies = {task["task_id"]: submission(coord, task, 0).model_dump_json() for task in tasks}
    app = create_app(coord, API_TOKEN, run_loop=False)
    durable: list[str] = []
    with served(app) as url:

        async def submit_all() -> list[int]:
            async with httpx.AsyncClient(base_url=url, headers=JSON_AUTH, timeout=60) as client:

                async def one(task_id: str) -> int:
                    reply = await client.post("/v1/rollouts", content=bodies[task_id])
                    if task_id in buffered_task_ids(puts.inner, coord.run):  # right after the answer
                        durable.append(task_id)
                    return reply.status_code

                return await asyncio.gather(*(one(task_id) for task_id in bodies))

        before = puts.puts
        statuses = asyncio.run(submit_all())
        assert coord.status().counters["rollouts_admitted"] == SUBMITS
    assert statuses == [200] * SUBMITS
    assert sorted(durable) == sorted(bodies)
    assert puts.puts - before <= SUBMITS // 4, f"{puts.puts - before} snapshot puts for {SUBMITS} submits"


def test_a_failed_put_is_answered_unavailable_on_the_loop(
    busy: tuple[Coordinator, SnapshotPuts], redis_url: str
) -> None:
    coord, puts = busy
    puts.fail = True
    task = coord.dispatcher.generate[0]
    body = submission(coord, task, 0).model_dump_json()
    app = create_app(coord, API_TOKEN, run_loop=False)
    with served(app) as url, httpx.Client(base_url=url, headers=JSON_AUTH, timeout=30) as client:
        reply = client.post("/v1/rollouts", content=body)
        assert (reply.status_code, reply.json()["error"]) == (503, "unavailable"), reply.text
        assert task["task_id"] not in buffered_task_ids(puts.inner, coord.run)
        puts.fail = False
        reply = client.post("/v1/rollouts", content=body)  # the worker retries
        assert (reply.status_code, reply.json()) == (200, {"status": "duplicate"})
    assert task["task_id"] in buffered_task_ids(puts.inner, coord.run)
