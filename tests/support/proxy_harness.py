"""Helpers to drive a real Coordinator (real Redis, FileBucket) in tests without a server or workers."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.bucket.layout import sha256_hex, write_version
from asyncgrpo.protocol.schemas import HeartbeatRequest, LeaseGrant, PublishRequest, RolloutSubmission, SubmitResult
from asyncgrpo.run.config import RunConfig
from proxy.coordinator.service import Coordinator
from proxy.coordinator.snapshot import Leadership
from tests.support.dispatcher import RecordingDispatcher


class ManualClock:
    """Milliseconds that move only when a test says so."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = start_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, seconds: float) -> None:
        self.now_ms += int(seconds * 1000)


T = TypeVar("T")


class _TestsLoop:
    """One event loop in a daemon thread for the whole test session: where the fleet's requests of a
    ``SyncCoordinator`` run (their asyncio Redis client belongs to it, ``proxy.coordinator.fleet``)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def run(self, call: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="tests-loop", daemon=True).start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(call, loop).result()


TESTS_LOOP = _TestsLoop()


class SyncCoordinator(Coordinator):
    """A Coordinator whose fleet requests (awaited on the server loop, ``fleet_requests``) a test calls as
    plain functions, from any thread: each runs on the tests' loop and returns (or raises) what it does."""

    def heartbeat(self, report: HeartbeatRequest) -> bool:
        return TESTS_LOOP.run(self.fleet_requests.heartbeat(report))

    def lease(self, worker_id: str, task_id: str, incarnation: str = "") -> LeaseGrant:
        return TESTS_LOOP.run(self.fleet_requests.lease(worker_id, task_id, incarnation))

    def renew(self, lease_id: str) -> LeaseGrant:
        return TESTS_LOOP.run(self.fleet_requests.renew(lease_id))

    def release(self, lease_id: str) -> bool:
        return TESTS_LOOP.run(self.fleet_requests.release(lease_id))

    def submit(self, submission: RolloutSubmission) -> SubmitResult:
        return TESTS_LOOP.run(self.fleet_requests.submit(submission))


def small_config(seed: int = 0, **async_fields: Any) -> RunConfig:
    fields = {"groups_per_task": 2, "groups_per_step": 4, "queue_maxsize": 8, "max_staleness": 1}
    fields.update(async_fields)
    return RunConfig.model_validate({"seed": seed, "async": fields})


def file_bucket(tmp_path: Path) -> Bucket:
    return open_bucket(f"file://{tmp_path / 'bucket'}")


def make_coordinator(
    redis_client: Redis,
    bucket: Bucket,
    *,
    run: str = "r1",
    config: RunConfig | None = None,
    num_prompts: int = 20,
    clock: ManualClock | None = None,
    dispatcher: RecordingDispatcher | None = None,
    require_generate_worker: bool = False,
    leadership: Leadership | None = None,
) -> SyncCoordinator:
    """``require_generate_worker`` off by default: these tests send no heartbeats. ``leadership``: the run's
    leadership this coordinator holds (unfenced by default)."""
    return SyncCoordinator(
        redis_client,
        bucket,
        run,
        config or small_config(),
        num_prompts,
        dispatcher or RecordingDispatcher(),
        clock_ms=clock or ManualClock(),
        config_sha256="0" * 64,
        prompts_sha256="1" * 64,
        require_generate_worker=require_generate_worker,
        leadership=leadership,
    )


def write_fake_version(
    bucket: Bucket, run: str, version: int, *, worker_id: str = "trainer-1", rollouts: list[str] | None = None
) -> str:
    """Upload a version (JSON-only files) the way a trainer does; returns its manifest sha256. ``rollouts``:
    the task ids of the batch it was made from, as a trainer records them (omitted: not checked)."""
    files = {"adapter_config.json": json.dumps({"r": 1, "version": version, "by": worker_id}).encode()}
    metadata: dict = {"step": version, "base_version": version - 1, "worker_id": worker_id}
    if rollouts is not None:
        metadata["rollouts"] = rollouts
    _, sha = write_version(bucket, run, version, files, metadata)
    return sha


def publish_request(version: int, sha: str, worker_id: str = "trainer-1") -> PublishRequest:
    return PublishRequest(
        version=version, base_version=version - 1, step=version, worker_id=worker_id, manifest_sha256=sha
    )


def publish_next(coord: Coordinator) -> int:
    """Write and publish the version of the step in flight (the caller ticked so that it is claimed)."""
    version = coord.current_version() + 1
    sha = write_fake_version(coord.bucket, coord.run, version)
    return coord.publish(publish_request(version, sha)).current_version


def start_run(coord: Coordinator) -> Coordinator:
    """Version 0 published and the first generate tasks dispatched, as a fresh run starts."""
    coord.tick()
    publish_next(coord)
    coord.tick()
    return coord


def leased_versions(coord: Coordinator, task_id: str, worker_id: str) -> set[int]:
    """The versions ``worker_id`` leased for ``task_id`` as its holder (what the proxy binds submissions to)."""
    holder, leases = coord.redis.hmget(coord.keys.task(task_id), ["worker_id", "leases"])
    if holder != worker_id or not leases:
        return set()
    return {int(entry.rsplit(":", 1)[1]) for entry in leases.split()}


def lease_task(coord: Coordinator, task: dict[str, Any], worker_id: str = "gen-1") -> LeaseGrant:
    """Lease the current version for a task, as its generate worker does before it samples."""
    return coord.lease(worker_id, task["task_id"])


def submission(
    coord: Coordinator,
    task: dict[str, Any],
    version: int,
    *,
    worker_id: str = "gen-1",
    rejected: dict[str, str] | None = None,
    lease: bool = True,
) -> RolloutSubmission:
    """A submission of every group of a recorded generate task (minus ``rejected``: group id -> reason).

    A worker submits under its lease of the task: with ``lease`` (the default), a task in flight that
    ``worker_id`` holds no lease of ``version`` for is leased now (and the lease goes with the submission,
    which releases it), so ``version`` must be current then; lease earlier (``lease_task``) for an older one.
    """
    rejected = rejected or {}
    group_ids = [g["group_id"] for g in task["groups"] if g["group_id"] not in rejected]
    lease_id = None
    in_flight = coord.redis.hget(coord.keys.task(task["task_id"]), "state") == "inflight"
    if lease and in_flight and version not in leased_versions(coord, task["task_id"], worker_id):
        assert version == coord.current_version(), (
            f"{worker_id} never leased v{version} for task {task['task_id']}: lease_task() while it is current"
        )
        lease_id = lease_task(coord, task, worker_id).lease_id
    return RolloutSubmission(
        task_id=task["task_id"],
        worker_id=worker_id,
        version=version,
        key=bucket_keys.rollout_key(coord.run, task["task_id"]),
        sha256=sha256_hex(task["task_id"].encode()),
        group_ids=group_ids,
        num_samples=4 * len(group_ids),
        rejected_groups=[{"group_id": gid, "reason": reason} for gid, reason in rejected.items()],
        stats={"reward_mean": 0.5},
        lease_id=lease_id,
    )


def submit_pending(coord: Coordinator, submitted: set[str], *, version: int | None = None) -> list[str]:
    """Submit every dispatched task not yet submitted, made with ``version`` (default: the current one)."""
    done = []
    for task in list(coord.dispatcher.generate):
        if task["task_id"] in submitted:
            continue
        submitted.add(task["task_id"])
        coord.submit(submission(coord, task, coord.current_version() if version is None else version))
        done.append(task["task_id"])
    return done


def advance_version(coord: Coordinator, submitted: set[str]) -> int:
    """Drive the run to the next version like a healthy cluster would: submit, claim, publish."""
    for _ in range(10):
        coord.tick()
        if coord.status().step_inflight is not None:
            return publish_next(coord)
        submit_pending(coord, submitted)
    raise AssertionError("no step could be claimed; is the buffer configuration able to fill a step?")


def step_at_pace(
    coord: Coordinator, clock: ManualClock, submitted: set[str], *, task_s: float, step_s: float, workers: int
) -> int:
    """One version as a steady fleet makes it: each dispatched task leased, then submitted ``task_s`` later by
    one of ``workers`` workers in turn; the step sent and published ``step_s`` later. Returns the version.
    Needs ``queue_maxsize == groups_per_step``, so that a step is claimed only once its tasks are submitted."""
    coord.tick()  # dispatch (with queue_maxsize = groups_per_step, never a claim: the buffer holds one step)
    tasks = [t for t in list(coord.dispatcher.generate) if t["task_id"] not in submitted]
    for n, task in enumerate(tasks):
        submitted.add(task["task_id"])
        worker = f"gen-{n % workers}"
        coord.lease(worker, task["task_id"])
        clock.advance(task_s)
        coord.submit(submission(coord, task, coord.current_version(), worker_id=worker))
    assert coord.tick().step_sent is not None, "the submitted tasks did not fill a step"
    clock.advance(step_s)
    return publish_next(coord)


def paced_coordinator(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> Coordinator:
    """A coordinator for ``step_at_pace``: 4 tasks of 2 groups per version, a buffer of one step, 5 steps."""
    base = small_config(groups_per_task=2, groups_per_step=8, queue_maxsize=8, max_staleness=2)
    config = base.model_copy(update={"optimizer": base.optimizer.model_copy(update={"total_steps": 5})})
    return make_coordinator(redis_client, bucket, config=config, clock=clock)
