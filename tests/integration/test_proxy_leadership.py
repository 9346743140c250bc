"""Fencing between proxies and the proxy's start-up checks, on a real private Redis and a file:// bucket.

The leadership and its epoch (``proxy.coordinator.snapshot``), snapshot writes conditional on it, the snapshot's
checksum, a rebuild that adopts newer versions (and refuses a foreign batch), an idempotent restore, Redis
``TIME`` as the default clock, and the start-up checks (``proxy.api.app``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectExists
from asyncgrpo.bucket.layout import write_version
from proxy.api.app import (
    ProxyStartupError,
    check_conditional_writes,
    check_eviction_policy,
    create_app,
    take_leadership,
)
from proxy.coordinator.service import Coordinator
from proxy.coordinator.snapshot import (
    LEADERSHIP_CHECK_S,
    Leadership,
    LeadershipHeld,
    LeadershipLost,
    SnapshotCorrupt,
    load_snapshot,
    load_stored_state,
    seal,
    snapshot_epoch,
)
from proxy.coordinator.snapshot_log import CompactionPolicy
from tests.integration.test_rebuild import busy_run, claim_step_3, restart
from tests.support.dispatcher import RecordingDispatcher
from tests.support.fixtures_coordinator import API_TOKEN
from tests.support.fixtures_redis import free_port
from tests.support.proxy_harness import (
    ManualClock,
    SyncCoordinator,
    file_bucket,
    make_coordinator,
    small_config,
    submission,
)

SNAPSHOT = bucket_keys.proxy_snapshot_key("r1")


@pytest.fixture
def bucket(tmp_path: Path) -> Bucket:
    return file_bucket(tmp_path)


def leading(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> Coordinator:
    leadership = Leadership(redis_client, "r1")
    take_leadership(leadership, bucket, standby=False)
    return SyncCoordinator(
        redis_client, bucket, "r1", small_config(), 20, RecordingDispatcher(), clock_ms=clock, leadership=leadership
    )


def test_second_fence_is_refused_naming_the_holder(redis_client: Redis, bucket: Bucket) -> None:
    first = Leadership(redis_client, "r1")
    assert take_leadership(first, bucket, standby=False) == 1
    with pytest.raises(ProxyStartupError, match=r"already coordinated by another proxy: host .* pid \d+ \(epoch 1"):
        take_leadership(Leadership(redis_client, "r1"), bucket, standby=False)
    assert first.confirm() == 1, "renewing keeps the epoch"
    assert 0 < redis_client.pttl(first.keys.proxy_leadership) <= 6000


def test_standby_waits_for_the_leadership_then_takes_a_higher_epoch(redis_client: Redis, bucket: Bucket) -> None:
    first = Leadership(redis_client, "r1")
    take_leadership(first, bucket, standby=False)
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            redis_client.delete(first.keys.proxy_leadership)  # the live proxy died; its leadership lapsed

    second = Leadership(redis_client, "r1")
    assert take_leadership(second, bucket, standby=True, sleep=sleep) == 2
    assert waits == [2.0, 2.0, 2.0], "a stand-by polls every third of the TTL"
    with pytest.raises(LeadershipLost, match=r"lost the leadership of run 'r1'"):
        first.confirm()


def test_snapshot_write_refused_after_losing_the_leadership(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord = leading(redis_client, bucket, clock)
    coord.tick()
    assert snapshot_epoch(bucket.get(SNAPSHOT)) == 1
    before = bucket.get(SNAPSHOT)
    redis_client.delete(coord.keys.proxy_leadership)
    Leadership(redis_client, "r1").acquire()  # another proxy took over
    coord.store.mark_changed()
    with pytest.raises(LeadershipLost):
        coord.snapshots.write(force=True)
    assert bucket.get(SNAPSHOT) == before, "the old proxy's write never reached the bucket"
    assert coord.leadership is not None and coord.leadership.lost is not None


def test_a_deposed_proxy_refuses_changes_but_answers_reads_and_unknown_methods(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    """Once a stand-by holds the run, the old proxy answers every change 503 (the client retries, reaching the
    new one), reads as before, and a method no route takes 405 like any proxy (it answered 503 before)."""
    coord = leading(redis_client, bucket, clock)
    coord.tick()
    redis_client.delete(coord.keys.proxy_leadership)
    Leadership(redis_client, "r1").acquire()  # a stand-by took over
    with pytest.raises(LeadershipLost):
        coord.leadership.confirm()  # type: ignore[union-attr]
    auth = {"Authorization": f"Bearer {API_TOKEN}"}
    with TestClient(create_app(coord, API_TOKEN, run_loop=False, stop_on_lost_leadership=lambda: None)) as http:
        lease = http.post("/v1/leases", json={"worker_id": "gen-1", "task_id": "t-1"}, headers=auth)
        assert lease.status_code == 503 and lease.json()["error"] == "unavailable"
        assert "lost the run's leadership" in lease.json()["detail"]
        assert http.get("/v1/status", headers=auth).status_code == 200
        assert http.request("TRACE", "/v1/status", headers=auth).status_code == 405


def test_snapshot_of_a_higher_epoch_is_never_overwritten(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    """Two proxies on two Redis (a wrong ASYNCGRPO_REDIS_URL): the other's write moves the snapshot's ETag, so
    the older proxy's next compaction is refused, reads the snapshot back and finds the higher epoch."""
    coord = leading(redis_client, bucket, clock)
    coord.tick()
    coord.snapshots.policy = CompactionPolicy(max_segments=0)  # every put a compaction
    replace_with_epoch(bucket, 7)
    with pytest.raises(LeadershipLost, match="epoch 7, above this proxy's 1"):
        coord.snapshots.write(force=True)
    assert snapshot_epoch(bucket.get(SNAPSHOT)) == 7


def replace_with_epoch(bucket: Bucket, epoch: int) -> None:
    """What another proxy of ``epoch`` (on another Redis) puts: this snapshot with its epoch."""
    newer = bucket.get(SNAPSHOT).replace(b'"proxy_epoch": 1', b'"proxy_epoch": %d' % epoch, 1)
    bucket.put(SNAPSHOT, seal(newer[: newer.rfind(b',"sha256":"')] + b"}"))


def test_a_proxy_putting_segments_stops_within_the_check_after_a_higher_epoch_wrote(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    """The same with the default policy, where most puts are log segments (new keys, which no other writer
    moves): a rebuild passes over segments of an older epoch than the snapshot's, so the writer reads the
    snapshot's ETag back every LEADERSHIP_CHECK_S and stops once a higher epoch wrote it."""
    coord = leading(redis_client, bucket, clock)
    now = [0.0]
    coord.snapshots.monotonic = lambda: now[0]
    coord.tick()
    assert coord.snapshots.write(force=True) and coord.snapshots.compactions == 1, "a segment, not a compaction"
    replace_with_epoch(bucket, 7)
    now[0] += LEADERSHIP_CHECK_S - 0.1
    coord.snapshots.write(force=True)  # within the interval: one more segment, which a rebuild passes over
    now[0] += 0.1
    with pytest.raises(LeadershipLost, match="epoch 7, above this proxy's 1"):
        coord.snapshots.write(force=True)
    assert snapshot_epoch(bucket.get(SNAPSHOT)) == 7
    assert load_stored_state(bucket, "r1").segments == 0, "the older epoch's segments are passed over"


@pytest.mark.parametrize("store", ["file", "seaweedfs"])
@pytest.mark.parametrize("put", ["segment", "compaction"])
def test_a_proxy_paused_past_its_leadership_never_writes_once_its_successor_has(
    redis_client: Redis, tmp_path: Path, clock: ManualClock, store: str, put: str, request: pytest.FixtureRequest
) -> None:
    """The gap the leadership alone leaves: a proxy confirms its leadership, pauses (GC, a stopped VM) past its
    TTL, and puts. The log's notes are taken only at the epoch that holds the leadership (atomically in Redis), and a
    compaction's put is conditional on the snapshot it last wrote, which its successor has replaced."""
    if store == "file":
        bucket = file_bucket(tmp_path)
    else:
        bucket = request.getfixturevalue("seaweedfs_endpoint").open(f"leadership-{uuid.uuid4().hex[:8]}")
    old = leading(redis_client, bucket, clock)
    old.tick()
    assert old.leadership is not None
    if put == "compaction":
        old.snapshots.policy = CompactionPolicy(max_segments=0)
    redis_client.delete(old.keys.proxy_leadership)  # the leadership lapsed during the pause
    new = leading(redis_client, bucket, clock)
    assert new.leadership is not None and new.leadership.epoch == 2
    new.snapshots.write(force=True)
    theirs = bucket.get(SNAPSHOT)
    assert snapshot_epoch(theirs) == 2
    log_before = bucket.list(bucket_keys.proxy_log_prefix("r1"))
    old.leadership.confirm = lambda: 1  # type: ignore[method-assign]  # it confirmed before the pause
    with pytest.raises(LeadershipLost, match=r"lost the leadership of run 'r1'.*epoch 2"):
        old.snapshots.write(force=True)
    assert bucket.get(SNAPSHOT) == theirs, "the paused proxy's put never reached the bucket"
    assert bucket.list(bucket_keys.proxy_log_prefix("r1")) == log_before, "nor did a segment"
    assert new.snapshots.write(force=True), "the successor goes on writing"


def test_a_segment_put_late_by_a_deposed_proxy_is_never_read(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    """A proxy took its segment's notes while it led, then paused before the put: its successor's first put is a
    compaction, which covers those changes (both read one Redis) and a number above the late segment's, so a
    rebuild never reads it; the next compaction deletes it."""
    old = leading(redis_client, bucket, clock)
    old.tick()
    old.store.mark_changed()
    held: list[tuple[str, bytes]] = []
    plain_put = bucket.put_if_match

    def pause(key: str, data: bytes, etag: str | None) -> str:
        held.append((key, data))  # the pause: this put lands only after the successor took over
        return "held"

    bucket.put_if_match = pause  # type: ignore[method-assign]
    dispatched = old.tick().tasks_sent
    assert held and bucket_keys.seq_from_log_key(held[0][0]), "the old proxy was putting a segment"
    bucket.put_if_match = plain_put  # type: ignore[method-assign]
    redis_client.delete(old.keys.proxy_leadership)
    new = leading(redis_client, bucket, clock)
    new.snapshots.write(force=True)
    through = json.loads(bucket.get(SNAPSHOT))["log_through"]
    bucket.put_if_match(held[0][0], held[0][1], None)  # the late put lands
    assert bucket_keys.seq_from_log_key(held[0][0]) < through
    stored = load_stored_state(bucket, "r1")
    assert stored.segments == 0
    assert stored.document is not None
    assert {item["task_id"] for item in stored.document["inflight_tasks"]} >= set(dispatched)
    new.snapshots.policy = CompactionPolicy(max_segments=0)
    new.snapshots.write(force=True)
    assert held[0][0] not in bucket.list(bucket_keys.proxy_log_prefix("r1")), "collected by the next compaction"


def test_a_late_put_of_a_lower_epoch_is_written_over(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    """A put that lands between the successor's read of the snapshot and its first put (or one whose answer was
    lost) leaves an ETag the writer did not expect: it reads the snapshot back, finds no higher epoch, and
    puts its own state (a superset: both read one Redis) over it."""
    coord = leading(redis_client, bucket, clock)
    coord.snapshots.policy = CompactionPolicy(max_segments=0)
    coord.tick()
    stale = bucket.get(SNAPSHOT)
    coord.snapshots.write(force=True)
    bucket.put(SNAPSHOT, stale)  # the late put
    assert coord.snapshots.write(force=True)
    assert bucket.get(SNAPSHOT) != stale and snapshot_epoch(bucket.get(SNAPSHOT)) == 1


@pytest.mark.parametrize("compact_every_put", [False, True])
def test_puts_are_conditional_not_read_back(
    redis_client: Redis, bucket: Bucket, clock: ManualClock, compact_every_put: bool
) -> None:
    """Group commits put once per batch of admissions: the writer reads the snapshot once, then each compaction is
    conditional on the ETag of its own last one and each segment is create-only (no GET per put)."""
    coord = leading(redis_client, bucket, clock)
    coord.snapshots.policy = (
        CompactionPolicy(max_segments=0) if compact_every_put else CompactionPolicy(log_to_snapshot=float("inf"))
    )
    reads: list[str] = []
    plain_get_tagged = bucket.get_tagged
    bucket.get_tagged = lambda key: reads.append(key) or plain_get_tagged(key)  # type: ignore[method-assign]
    coord.tick()
    for _ in range(5):
        assert coord.snapshots.write(force=True)
    assert reads == [SNAPSHOT]
    assert coord.snapshots.compactions == (6 if compact_every_put else 1)


def test_flushall_reacquires_with_a_higher_epoch_and_goes_on(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord = leading(redis_client, bucket, clock)
    coord.tick()
    redis_client.flushall()  # the leadership, the epoch counter and the state are gone
    assert coord.tick().rebuilt is not None
    assert coord.leadership is not None and coord.leadership.epoch == 2 and coord.leadership.lost is None
    assert snapshot_epoch(bucket.get(SNAPSHOT)) == 2


def test_epoch_never_below_the_snapshot_after_redis_is_emptied(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord = leading(redis_client, bucket, clock)
    for _ in range(3):  # epochs 1..3 come and go
        redis_client.delete(coord.keys.proxy_leadership)
        coord.tick()
        coord.snapshots.write(force=True)
    assert snapshot_epoch(bucket.get(SNAPSHOT)) == 4
    redis_client.flushall()
    assert take_leadership(Leadership(redis_client, "r1"), bucket, standby=False) == 5


def test_snapshot_checksum_mismatch_is_an_error_naming_the_key(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord, _ = busy_run(redis_client, bucket, clock)
    coord.snapshots.write(force=True)
    data = bucket.get(SNAPSHOT)
    assert json.loads(data)["sha256"] and load_snapshot(bucket, "r1") is not None
    bucket.put(SNAPSHOT, data.replace(b'"epoch_pos":"', b'"epoch_pos":"1', 1))  # still valid JSON
    redis_client.flushall()
    with pytest.raises(SnapshotCorrupt, match=r"runs/r1/proxy/snapshot\.json fails its checksum"):
        restart(redis_client, bucket, clock).ensure_state()


def test_rebuild_adopts_newer_contiguous_versions(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    """The snapshot knows v2 and step 3 claimed; the bucket holds v3 (that batch) and v4 (a later batch)."""
    coord, submitted = busy_run(redis_client, bucket, clock)
    pending = claim_step_3(coord, submitted)
    step = coord.get_step(3)
    claimed = [ref.task_id for ref in step.rollouts]
    later = [t["task_id"] for t in pending[:2]]
    for task in pending[:2]:
        coord.submit(submission(coord, task, 2))
    coord.snapshots.write(force=True)
    gids = [g for tid in claimed + later for g in json.loads(coord.redis.hget(coord.keys.rollout(tid), "group_ids"))]
    assert len(gids) == 8
    write_version(bucket, "r1", 3, {"a.json": b"{}"}, {"step": 3, "base_version": 2, "rollouts": claimed})
    write_version(bucket, "r1", 4, {"a.json": b"{}"}, {"step": 4, "base_version": 3, "rollouts": later})
    redis_client.flushall()
    fresh = restart(redis_client, bucket, clock)
    fresh.ensure_state()
    assert fresh.current_version() == 4, "never behind the latest version it can account for"
    assert fresh.status().step_inflight is None
    assert fresh.redis.lrange(fresh.keys.buffer, 0, -1) == []
    assert {fresh.group_record(gid)["state"] for gid in gids} == {"trained"}
    assert fresh.status().counters["publish"] == 5


def test_rebuild_refuses_a_manifest_for_a_different_batch(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord, submitted = busy_run(redis_client, bucket, clock)
    claim_step_3(coord, submitted)
    batch = coord.get_step(3)
    # An old upload for step 3 on base 2, but of another batch (a trainer from before a rebuild).
    write_version(bucket, "r1", 3, {"a.json": b"{}"}, {"step": 3, "base_version": 2, "rollouts": ["gen-other"]})
    redis_client.flushall()
    fresh = restart(redis_client, bucket, clock)
    fresh.ensure_state()
    assert fresh.current_version() == 2
    assert fresh.status().step_inflight == 3
    assert fresh.get_step(3) == batch
    assert fresh.status().counters["versions_not_adopted"] == 1


def test_restore_onto_a_partly_evicted_redis_does_not_duplicate_the_buffer(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord, _ = busy_run(redis_client, bucket, clock)
    coord.snapshots.write(force=True)
    buffered = redis_client.lrange(coord.keys.buffer, 0, -1)
    assert buffered
    redis_client.delete(coord.keys.state)  # evicted: the state key gone, the buffer list left behind
    fresh = restart(redis_client, bucket, clock)
    assert fresh.ensure_state() == "rebuilt"
    assert redis_client.lrange(coord.keys.buffer, 0, -1) == buffered


def test_default_clock_is_redis_time(redis_client: Redis, bucket: Bucket) -> None:
    coord = SyncCoordinator(redis_client, bucket, "r1", small_config(), 20, RecordingDispatcher())
    seconds, micros = redis_client.time()
    assert abs(coord.clock_ms() - (seconds * 1000 + micros // 1000)) < 1000
    assert make_coordinator(redis_client, bucket, clock=ManualClock(5)).clock_ms() == 5


@pytest.fixture
def evicting_redis(tmp_path: Path) -> Iterator[Redis]:
    """A private redis-server started with ``--maxmemory-policy allkeys-lru``."""
    port = free_port()
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--maxmemory-policy", "allkeys-lru"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = Redis(host="127.0.0.1", port=port, decode_responses=True)
    try:
        for _ in range(500):
            try:
                client.ping()
                break
            except Exception:
                if process.poll() is not None:
                    raise
                import time

                time.sleep(0.02)
        yield client
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_evicting_redis_is_refused_unless_allowed(evicting_redis: Redis, redis_client: Redis) -> None:
    with pytest.raises(ProxyStartupError, match=r"maxmemory-policy 'allkeys-lru'.*ASYNCGRPO_ALLOW_REDIS_EVICTION=1"):
        check_eviction_policy(evicting_redis, allow=False)
    assert check_eviction_policy(evicting_redis, allow=True) == "allkeys-lru"
    assert check_eviction_policy(redis_client, allow=False) == "noeviction"


class IgnoresIfNoneMatch:
    """A bucket double over a real one that drops ``if_absent``, as a store ignoring If-None-Match does."""

    def __init__(self, inner: Bucket) -> None:
        self.inner = inner
        self.url = inner.url

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.inner.put(key, data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class IgnoresIfMatch(IgnoresIfNoneMatch):
    """One that honours If-None-Match but drops If-Match, as some S3-compatible stores do."""

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def put_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        self.inner.put(key, data)
        return self.inner.get_tagged(key)[1]


@pytest.mark.parametrize(
    ("careless", "ignored"),
    [(IgnoresIfNoneMatch, "If-None-Match: \\* succeeded"), (IgnoresIfMatch, "If-Match on an ETag it no longer had")],
)
def test_bucket_ignoring_conditional_writes_is_refused(bucket: Bucket, careless: type, ignored: str) -> None:
    assert check_conditional_writes(bucket, "r1", allow=False)
    double = careless(bucket)
    with pytest.raises(ProxyStartupError, match=rf"ignores conditional writes.*{ignored}.*ALLOW_UNCONDITIONAL_BUCKET"):
        check_conditional_writes(double, "r1", allow=False)
    assert not check_conditional_writes(double, "r1", allow=True)
    assert bucket.list("runs/r1/proxy/") == [], "the probe is deleted"
    with pytest.raises(ObjectExists):  # the real bucket does refuse
        bucket.put("x", b"1", if_absent=True) or bucket.put("x", b"1", if_absent=True)


def test_leadership_held_error_names_what_to_do(redis_client: Redis) -> None:
    Leadership(redis_client, "r1").acquire()
    with pytest.raises(LeadershipHeld, match="--standby or ASYNCGRPO_PROXY_STANDBY=1"):
        Leadership(redis_client, "r1").acquire()
