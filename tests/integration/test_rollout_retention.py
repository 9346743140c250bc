"""Retention of rollout objects in the bucket (``async.rollout_retention_versions``), done by the proxy's GC.

Real private Redis, FileBucket, manual clock. The harness's submissions write no object, so these tests write
each rollout object the way a generate worker does (before it submits) and then watch which objects the
proxy deletes, and when.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError
from asyncgrpo.protocol.schemas import StaleRolloutError
from proxy.coordinator.scripts import TaskCancelled
from proxy.coordinator.service import Coordinator
from tests.support.dispatcher import RecordingDispatcher
from tests.support.proxy_harness import (
    ManualClock,
    file_bucket,
    lease_task,
    make_coordinator,
    publish_next,
    small_config,
    submission,
)


@pytest.fixture
def bucket(tmp_path: Path) -> Bucket:
    return file_bucket(tmp_path)


def coordinator(redis_client: Redis, bucket: Bucket, clock: ManualClock, **async_fields: Any) -> Coordinator:
    return make_coordinator(redis_client, bucket, config=small_config(**async_fields), clock=clock)


def write_rollout(coord: Coordinator, task_id: str) -> None:
    """What a generate worker does before it submits: put its rollout object in the bucket."""
    coord.bucket.put(bucket_keys.rollout_key(coord.run, task_id), json.dumps({"task_id": task_id}).encode())


def exists(coord: Coordinator, task_id: str) -> bool:
    return coord.bucket.head(bucket_keys.rollout_key(coord.run, task_id)) is not None


def stored_task_ids(coord: Coordinator) -> set[str]:
    prefix = bucket_keys.rollouts_prefix(coord.run)
    return {key.removeprefix(prefix).removesuffix(".safetensors") for key in coord.bucket.list(prefix)}


def submit_written(coord: Coordinator, task: dict[str, Any], version: int, **kwargs: Any) -> None:
    write_rollout(coord, task["task_id"])
    coord.submit(submission(coord, task, version, **kwargs))


def submit_pending(coord: Coordinator, submitted: set[str]) -> None:
    for task in list(coord.dispatcher.generate):
        if task["task_id"] not in submitted:
            submitted.add(task["task_id"])
            submit_written(coord, task, coord.current_version())


def start(coord: Coordinator) -> None:
    """Init step published as version 0; the first generate tasks dispatched."""
    coord.tick()
    assert publish_next(coord) == 0
    coord.tick()


def next_version(coord: Coordinator, submitted: set[str]) -> int:
    """Submit (with objects), claim and publish the next version, then tick once so that the GC runs."""
    for _ in range(10):
        coord.tick()
        if coord.status().step_inflight is not None:
            version = publish_next(coord)
            coord.tick()
            return version
        submit_pending(coord, submitted)
    raise AssertionError("no step could be claimed")


def trained_in(coord: Coordinator) -> dict[str, int]:
    """task id -> the version whose step trained it (every optimize message sent, one step per version)."""
    return {ref["task_id"]: message["step"] for message in coord.dispatcher.optimize for ref in message["rollouts"]}


def needed(coord: Coordinator) -> set[str]:
    """Rollouts that may still be trained: buffered, or in the step in flight."""
    out = set(coord.redis.lrange(coord.keys.buffer, 0, -1))
    step = coord.status().step_inflight
    if step is not None:
        out |= {ref.task_id for ref in coord.get_step(step).rollouts}
    return out


def queued(coord: Coordinator) -> dict[str, int]:
    return {tid: int(score) for tid, score in coord.redis.zrange(coord.keys.rollout_retention, 0, -1, withscores=True)}


# ---- trained rollouts ----


@pytest.mark.parametrize("retention", [0, 2])
def test_trained_rollouts_go_after_the_window_and_not_before(
    redis_client: Redis, bucket: Bucket, clock: ManualClock, retention: int
) -> None:
    coord = coordinator(redis_client, bucket, clock, rollout_retention_versions=retention)
    start(coord)
    submitted: set[str] = set()
    for expected in range(1, 6):
        current = next_version(coord, submitted)
        assert current == expected
        trained = trained_in(coord)
        assert trained, "some rollouts were trained"
        for task_id, version in trained.items():
            assert exists(coord, task_id) == (current < version + retention), (
                f"rollout {task_id} trained into v{version} at v{current} with retention {retention}"
            )
        for task_id in needed(coord):
            assert exists(coord, task_id), f"needed rollout {task_id} was deleted"
    gone = [tid for tid in trained_in(coord) if not exists(coord, tid)]
    assert gone and coord.status().counters["rollouts_deleted"] == len(gone)


def test_buffered_and_claimed_rollouts_are_never_deleted(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord = coordinator(redis_client, bucket, clock, rollout_retention_versions=0)
    start(coord)
    submit_pending(coord, set())
    assert coord.tick().step_claimed == 1
    claimed = {ref.task_id for ref in coord.get_step(1).rollouts}
    buffered = set(coord.redis.lrange(coord.keys.buffer, 0, -1))
    assert claimed and buffered
    # Even if something queued them by mistake, with a score long due, the GC must not touch them.
    coord.redis.zadd(coord.keys.rollout_retention, {tid: -5 for tid in claimed | buffered})
    for _ in range(3):
        clock.advance(coord.config.async_.optimize_task_timeout_s + 1)
        report = coord.tick()  # also cancels the newer generate tasks, which do go (they wrote nothing)
        assert not set(report.rollouts_deleted) & (claimed | buffered)
    assert coord.dispatcher.optimize[-1]["step"] == 1, "the step was re-sent while unpublished"
    assert all(exists(coord, tid) for tid in claimed | buffered), "a redelivered optimize task finds its rollouts"
    assert queued(coord) == {}, "the mistaken entries left the queue"
    # Published: the claimed ones go (retention 0), the buffered ones stay.
    publish_next(coord)
    assert set(coord.tick().rollouts_deleted) == claimed
    assert not any(exists(coord, tid) for tid in claimed)
    assert all(exists(coord, tid) for tid in buffered & needed(coord))


# ---- rollouts that will never be trained ----


def test_stale_rollouts_go_at_the_same_pace(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord = coordinator(redis_client, bucket, clock, rollout_retention_versions=1)
    start(coord)
    late = coord.dispatcher.generate[0]
    lease_task(coord, late)  # on v0
    submitted = {late["task_id"]}
    next_version(coord, submitted)
    next_version(coord, submitted)
    write_rollout(coord, late["task_id"])
    with pytest.raises(StaleRolloutError):
        coord.submit(submission(coord, late, version=0))
    assert queued(coord)[late["task_id"]] == 2, "queued at the version current when it was dropped"
    coord.tick()
    assert exists(coord, late["task_id"]), "kept for one version after the drop"
    next_version(coord, submitted)
    assert not exists(coord, late["task_id"])


def test_rollouts_dropped_as_stale_at_claim_go_too(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord = coordinator(redis_client, bucket, clock, rollout_retention_versions=0, max_staleness=0, groups_per_step=4)
    start(coord)
    x, y, a = coord.dispatcher.generate[:3]
    for task in (x, y, a):
        submit_written(coord, task, 0)
    assert coord.tick().step_claimed == 1
    assert exists(coord, a["task_id"]), "buffered while step 1 trains"
    publish_next(coord)
    report = coord.tick()
    assert report.stale_dropped == 2, "a (v0) is too stale for a step from v1"
    assert set(report.rollouts_deleted) == {x["task_id"], y["task_id"], a["task_id"]}


def test_cancelled_and_rejected_rollouts_go_too(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord = coordinator(redis_client, bucket, clock, rollout_retention_versions=1)
    start(coord)
    first_tasks = {t["task_id"] for t in coord.dispatcher.generate}  # all get cancelled or submitted below
    lost, rejected = coord.dispatcher.generate[0], coord.dispatcher.generate[1]
    submit_written(coord, rejected, 0, rejected={g["group_id"]: "prompt too long" for g in rejected["groups"]})
    write_rollout(coord, lost["task_id"])  # the worker wrote its rollout, then vanished
    clock.advance(coord.config.async_.generate_task_timeout_s + 1)
    assert coord.tick().tasks_cancelled >= 1
    assert {lost["task_id"], rejected["task_id"]} <= set(queued(coord))
    assert exists(coord, lost["task_id"]) and exists(coord, rejected["task_id"])
    submitted = set(first_tasks)
    next_version(coord, submitted)
    assert not exists(coord, lost["task_id"]) and not exists(coord, rejected["task_id"])
    # The lost worker comes back, writes its rollout again and submits: refused, and queued again.
    write_rollout(coord, lost["task_id"])
    with pytest.raises(TaskCancelled):
        coord.submit(submission(coord, lost, 0))
    coord.tick()
    assert exists(coord, lost["task_id"]), "kept for one version after the refusal"
    next_version(coord, submitted)
    assert not exists(coord, lost["task_id"])


def test_a_trained_rollout_written_again_by_a_redelivery_goes_again(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord = coordinator(redis_client, bucket, clock, rollout_retention_versions=0)
    start(coord)
    submitted: set[str] = set()
    next_version(coord, submitted)
    task_id = next(iter(trained_in(coord)))
    assert not exists(coord, task_id)
    task = next(t for t in coord.dispatcher.generate if t["task_id"] == task_id)
    submit_written(coord, task, 0)  # a redelivered generate task found no object and made it again
    assert coord.tick().rollouts_deleted == [task_id]


def test_minus_one_keeps_every_rollout(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord = coordinator(redis_client, bucket, clock, rollout_retention_versions=-1)
    start(coord)
    late = coord.dispatcher.generate[0]
    lease_task(coord, late)  # on v0
    write_rollout(coord, late["task_id"])
    submitted = {late["task_id"]}
    for _ in range(4):
        next_version(coord, submitted)
    with pytest.raises(StaleRolloutError):
        coord.submit(submission(coord, late, version=0))
    for _ in range(2):
        next_version(coord, submitted)
    assert stored_task_ids(coord) == submitted
    assert len(trained_in(coord)) >= 8
    assert not coord.redis.exists(coord.keys.rollout_retention), "nothing is even queued"
    assert coord.status().counters.get("rollouts_deleted", 0) == 0


# ---- idempotence and failures ----


def test_deletion_is_idempotent_and_a_failed_delete_stays_queued(
    redis_client: Redis, bucket: Bucket, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = coordinator(redis_client, bucket, clock, rollout_retention_versions=0)
    start(coord)
    submit_pending(coord, set())
    coord.tick()

    def unreachable(key: str) -> None:
        raise BucketError(f"connection refused deleting {key}")

    monkeypatch.setattr(coord.bucket, "delete", unreachable)
    publish_next(coord)
    trained = set(trained_in(coord))
    assert coord.tick().rollouts_deleted == []
    assert all(exists(coord, tid) for tid in trained) and trained <= set(queued(coord))
    monkeypatch.undo()
    # One object vanished meanwhile (deleted by hand): deleting it again is not an error.
    gone_already = sorted(trained)[0]
    bucket.delete(bucket_keys.rollout_key(coord.run, gone_already))
    assert set(coord.tick().rollouts_deleted) == trained
    assert not any(exists(coord, tid) for tid in trained)
    assert not trained & set(queued(coord))
    assert coord.retention.collect_rollouts() == [] and coord.tick().rollouts_deleted == []
    assert coord.status().counters["rollouts_deleted"] == len(trained)


# ---- rebuilds ----


def restart(redis_client: Redis, bucket: Bucket, clock: ManualClock, config_coord: Coordinator) -> Coordinator:
    return make_coordinator(
        redis_client, bucket, config=config_coord.config, clock=clock, dispatcher=RecordingDispatcher()
    )


def test_rebuild_from_the_snapshot_keeps_the_queue_and_the_buffer(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord = coordinator(redis_client, bucket, clock, rollout_retention_versions=2)
    start(coord)
    submitted: set[str] = set()
    for _ in range(3):
        next_version(coord, submitted)
    submit_pending(coord, submitted)
    coord.tick()
    before_queue = queued(coord)
    before_needed = needed(coord)
    trained = {tid: v for tid, v in trained_in(coord).items() if v <= coord.current_version()}
    assert before_queue and before_needed
    # A rollout the snapshot never heard of (written after it, its task unknown after the rebuild).
    write_rollout(coord, "gen-r1-0-99999999")

    redis_client.flushall()
    fresh = restart(redis_client, bucket, clock, coord)
    assert fresh.ensure_state() == "rebuilt"
    after_queue = queued(fresh)
    current = fresh.current_version()
    for task_id, version in before_queue.items():
        if exists(fresh, task_id):
            assert after_queue[task_id] == version, "queued rollouts keep their version"
    assert after_queue["gen-r1-0-99999999"] == current
    assert not set(after_queue) & needed(fresh), "buffered and claimed rollouts are not queued"
    assert needed(fresh) == before_needed

    fresh.tick()
    for task_id in needed(fresh):
        assert exists(fresh, task_id)
    for task_id, version in trained.items():
        assert exists(fresh, task_id) == (current < version + 2)
    submitted_after: set[str] = set()
    for _ in range(2):
        next_version(fresh, submitted_after)
    assert not exists(fresh, "gen-r1-0-99999999")
    assert not any(exists(fresh, tid) for tid in trained)
    assert all(exists(fresh, tid) for tid in needed(fresh))


def test_rebuild_without_a_snapshot_queues_every_rollout(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord = coordinator(redis_client, bucket, clock, rollout_retention_versions=1)
    start(coord)
    submitted: set[str] = set()
    next_version(coord, submitted)
    submit_pending(coord, submitted)
    coord.tick()
    assert needed(coord), "some rollouts were buffered or claimed"
    stored = stored_task_ids(coord)

    redis_client.flushall()
    bucket.delete(bucket_keys.proxy_snapshot_key("r1"))
    fresh = restart(redis_client, bucket, clock, coord)
    assert fresh.ensure_state() == "rebuilt_from_versions"
    # Without a snapshot nothing is buffered or in flight: every old rollout is finished.
    assert queued(fresh) == {tid: 1 for tid in stored}
    fresh.tick()
    assert stored_task_ids(fresh) >= stored, "kept for one version"
    next_version(fresh, set())
    assert not stored & stored_task_ids(fresh)
