"""Invariant 6 for the proxy: an empty Redis is rebuilt from the bucket (snapshot + latest manifest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.bucket.layout import write_version
from proxy.coordinator.scripts import StateMissing, TaskCancelled
from proxy.coordinator.service import Coordinator
from proxy.coordinator.snapshot import SnapshotCorrupt
from tests.support.dispatcher import RecordingDispatcher
from tests.support.proxy_harness import (
    ManualClock,
    advance_version,
    file_bucket,
    make_coordinator,
    publish_next,
    submission,
    write_fake_version,
)


@pytest.fixture
def bucket(tmp_path: Path) -> Bucket:
    return file_bucket(tmp_path)


def restart(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> Coordinator:
    """A new proxy process: fresh coordinator object, fresh dispatcher, same Redis and bucket."""
    return make_coordinator(redis_client, bucket, clock=clock, dispatcher=RecordingDispatcher())


def busy_run(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> tuple[Coordinator, set[str]]:
    """Version 2 published, two rollouts admitted and buffered, two tasks in flight."""
    coord = make_coordinator(redis_client, bucket, clock=clock)
    submitted: set[str] = set()
    coord.tick()
    publish_next(coord)
    advance_version(coord, submitted)
    advance_version(coord, submitted)
    coord.tick()
    pending = [t for t in coord.dispatcher.generate if t["task_id"] not in submitted]
    for task in pending[:1]:
        coord.submit(submission(coord, task, coord.current_version()))
        submitted.add(task["task_id"])
    return coord, submitted


def claim_step_3(coord: Coordinator, submitted: set[str]) -> list[dict]:
    """From ``busy_run``: one more rollout admitted, so the tick claims step 3 on base 2. Returns the tasks
    still in flight after it (none submitted)."""
    pending = [t for t in coord.dispatcher.generate if t["task_id"] not in submitted]
    coord.submit(submission(coord, pending[0], 2))
    coord.tick()
    return pending[1:]


def test_flushall_then_restart_keeps_version_and_admitted_rollouts(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord, submitted = busy_run(redis_client, bucket, clock)
    before = coord.status()
    buffered = coord.redis.lrange(coord.keys.buffer, 0, -1)
    inflight = [t for t in coord.dispatcher.generate if t["task_id"] not in submitted]
    assert before.current_version == 2 and before.groups_buffered == 2 and buffered
    assert inflight, "some generate tasks were in flight"

    redis_client.flushall()
    fresh = restart(redis_client, bucket, clock)
    assert fresh.ensure_state() == "rebuilt"
    after = fresh.status()
    assert after.current_version == 2
    assert fresh.redis.lrange(fresh.keys.buffer, 0, -1) == buffered, "no admitted rollout lost"
    assert after.groups_buffered == 2 and after.groups_inflight == 0
    assert after.counters["rollouts_admitted"] == before.counters["rollouts_admitted"]
    # Tasks that were in flight are cancelled: late submissions are refused, their prompts come back first.
    with pytest.raises(TaskCancelled):
        fresh.submit(submission(fresh, inflight[0], 2))
    lost_prompts = [g["prompt_index"] for t in inflight for g in t["groups"]]
    fresh.tick()
    resent = [g["prompt_index"] for t in fresh.dispatcher.generate for g in t["groups"]]
    assert resent[: len(lost_prompts)] == lost_prompts
    new_ids = {t["task_id"] for t in fresh.dispatcher.generate}
    old_ids = {t["task_id"] for t in coord.dispatcher.generate}
    assert new_ids.isdisjoint(old_ids), "a rebuilt proxy never reuses a task id"
    # A duplicate of an admitted rollout is still recognised.
    admitted_task = next(t for t in coord.dispatcher.generate if t["task_id"] == buffered[0])
    assert fresh.submit(submission(fresh, admitted_task, 2)).status == "duplicate"


def test_claimed_step_is_resent_with_the_same_batch(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord, submitted = busy_run(redis_client, bucket, clock)
    claim_step_3(coord, submitted)
    step = coord.dispatcher.optimize[-1]
    assert step["step"] == 3
    redis_client.flushall()
    fresh = restart(redis_client, bucket, clock)
    report = fresh.tick()
    assert report.rebuilt == "rebuilt" and report.step_sent == 3
    assert fresh.dispatcher.optimize == [step]
    assert fresh.get_step(3).model_dump(mode="json") == {k: step[k] for k in ("step", "base_version", "rollouts")}
    assert publish_next(fresh) == 3


def test_version_published_to_the_bucket_but_not_redis_is_adopted(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord, submitted = busy_run(redis_client, bucket, clock)
    pending = claim_step_3(coord, submitted)
    batch = coord.get_step(3)
    # The trainer uploads version 3 (manifest last) and Redis dies before its publish arrives.
    write_fake_version(bucket, "r1", 3)
    redis_client.flushall()
    fresh = restart(redis_client, bucket, clock)
    fresh.tick()
    assert fresh.current_version() == 3
    for ref in batch.rollouts:
        for gid in ref.group_ids:
            assert fresh.group_record(gid)["state"] == "trained"
    status = fresh.status()
    assert status.step_inflight is None and fresh.dispatcher.optimize == [], "step 3 is done, not re-sent"
    assert status.counters["publish"] == 4 and status.counters["groups_trained"] == 12
    with pytest.raises(TaskCancelled):  # nothing else changed: the rebuilt proxy moves on from v3
        fresh.submit(submission(fresh, pending[0], 2))


def test_version_not_from_the_claimed_step_is_not_adopted(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord, submitted = busy_run(redis_client, bucket, clock)
    claim_step_3(coord, submitted)
    write_version(bucket, "r1", 3, {"adapter_config.json": b"{}"}, {"step": 3, "base_version": 1})
    redis_client.flushall()
    fresh = restart(redis_client, bucket, clock)
    fresh.ensure_state()
    assert fresh.current_version() == 2
    assert fresh.status().step_inflight == 3


def test_leases_survive_a_rebuild(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord, _ = busy_run(redis_client, bucket, clock)
    lease = coord.lease("gen-1", "t")
    coord.snapshots.write(force=True)
    redis_client.flushall()
    fresh = restart(redis_client, bucket, clock)
    fresh.ensure_state()
    clock.advance(30)
    assert fresh.renew(lease.lease_id).version == 2
    assert 0 < redis_client.pttl(fresh.keys.lease(lease.lease_id)) <= 60_000


def test_running_proxy_rebuilds_when_redis_empties_under_it(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord, _ = busy_run(redis_client, bucket, clock)
    redis_client.flushall()
    assert coord.lease("gen-1", "t").version == 2, "a request rebuilds the state it needs"
    redis_client.flushall()
    assert coord.tick().rebuilt == "rebuilt"
    assert coord.current_version() == 2


def test_a_request_that_still_finds_no_state_after_a_rebuild_says_so(
    redis_client: Redis, bucket: Bucket, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord, _ = busy_run(redis_client, bucket, clock)
    rebuilds: list[str] = []
    monkeypatch.setattr(coord.restorer, "ensure", lambda: rebuilds.append("tried") or "rebuilt")
    redis_client.flushall()
    with pytest.raises(StateMissing, match="even after a rebuild"):
        coord.lease("gen-1", "t")
    assert rebuilds == ["tried"], "one rebuild per request, then the refusal"


def test_no_snapshot_starts_from_the_latest_version(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord, _ = busy_run(redis_client, bucket, clock)
    bucket.delete(bucket_keys.proxy_snapshot_key("r1"))
    redis_client.flushall()
    fresh = restart(redis_client, bucket, clock)
    assert fresh.ensure_state() == "rebuilt_from_versions"
    assert fresh.current_version() == 2
    assert fresh.lease("g", "t").manifest_sha256 == coord.redis.hget(fresh.keys.versions, "2")
    fresh.tick()
    assert fresh.dispatcher.generate[0]["task_id"] not in {t["task_id"] for t in coord.dispatcher.generate}


def test_corrupt_snapshot_is_an_error_naming_the_key(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    busy_run(redis_client, bucket, clock)
    bucket.put(bucket_keys.proxy_snapshot_key("r1"), b"{truncated")
    redis_client.flushall()
    with pytest.raises(SnapshotCorrupt, match=r"runs/r1/proxy/snapshot\.json"):
        restart(redis_client, bucket, clock).ensure_state()
    bucket.put(bucket_keys.proxy_snapshot_key("r1"), json.dumps({"format": 99, "run": "r1"}).encode())
    with pytest.raises(SnapshotCorrupt, match="format 99"):
        restart(redis_client, bucket, clock).ensure_state()
