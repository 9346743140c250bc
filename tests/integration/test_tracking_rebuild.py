"""Tracker progress survives an empty Redis (invariant 6): the snapshot carries it and a rebuild restores it.

A real coordinator on real Redis and a file:// bucket publishes versions; the forwarder sends their step
records and eval records to real trackio (its stored rows show any duplicate) or to a recording tracker.
Redis is then flushed and rebuilt from the bucket: nothing already sent goes out again, and new steps do.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.run.config import RunConfig, TrackingConfig
from proxy.coordinator.scripts import StateMissing
from proxy.coordinator.service import Coordinator
from proxy.coordinator.snapshot import load_snapshot, seal
from proxy.tracking.forwarder import Forwarder, TrackerFollower, TrackerMetrics, start_forwarding
from proxy.tracking.trackers import Tracker, TrackerRun
from tests.support.dispatcher import RecordingDispatcher
from tests.support.proxy_harness import ManualClock, advance_version, file_bucket, make_coordinator, publish_next
from tests.support.tracker_doubles import RUN, put_eval, step_record, trackio_dir, trackio_logs, wait_until

POLL_S = 0.05


@pytest.fixture
def bucket(tmp_path: Path) -> Bucket:
    return file_bucket(tmp_path)


def _publish_with_record(coord: Coordinator, submitted: set[str]) -> int:
    """Publish the next version and leave its step record in metrics/ (fake versions carry none to copy)."""
    version = advance_version(coord, submitted)
    coord.bucket.put(bucket_keys.metrics_key(RUN, version), step_record(version).model_dump_json().encode())
    return version


def _tracking(redis_client: Redis, coord: Coordinator) -> dict[str, str]:
    return redis_client.hgetall(coord.keys.tracking)


def _rebuilt(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> Coordinator:
    """A new proxy process after Redis emptied: fresh coordinator, state rebuilt from the bucket."""
    fresh = make_coordinator(redis_client, bucket, clock=clock, dispatcher=RecordingDispatcher())
    assert fresh.ensure_state() == "rebuilt"
    return fresh


def test_trackio_gets_nothing_twice_after_redis_is_flushed_and_rebuilt(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    trackio_dir()
    project = f"test-{uuid.uuid4().hex[:8]}"
    config = RunConfig(tracking=TrackingConfig(report_to=["trackio"], project=project))
    coord = make_coordinator(redis_client, bucket, clock=clock)
    submitted: set[str] = set()
    coord.tick()
    publish_next(coord)  # version 0: no record
    for _ in range(3):
        _publish_with_record(coord, submitted)
    put_eval(bucket, 0, {"pass@1": 0.125})
    put_eval(bucket, 2, {"pass@1": 0.5})

    def start(owner: Coordinator) -> Forwarder:
        return start_forwarding(
            config,
            RUN,
            redis=redis_client,
            bucket=bucket,
            registry=CollectorRegistry(),
            on_progress=owner.store.mark_changed,
            poll_s=POLL_S,
        )

    first = start(coord)
    second: Forwarder | None = None
    try:
        wait_until(lambda: _tracking(redis_client, coord).get("trackio:step") == "3", "steps 1-3 sent")
        wait_until(lambda: "trackio:eval:2" in _tracking(redis_client, coord), "eval of version 2 sent")
        assert coord.snapshots.write(), "the forwarder's progress marked a snapshot change"
        snapshot = load_snapshot(bucket, RUN)
        assert snapshot is not None and snapshot["tracking"] == {"trackio": {"step": 3, "evals": [0, 2]}}

        # Redis empties under the running forwarder: it sends nothing (its cursor would read 0) until rebuilt.
        redis_client.flushall()
        time.sleep(10 * POLL_S)
        assert _tracking(redis_client, coord) == {}
        fresh = _rebuilt(redis_client, bucket, clock)
        restored = _tracking(redis_client, fresh)
        assert restored["trackio:step"] == "3" and {"trackio:eval:0", "trackio:eval:2"} <= set(restored)
        time.sleep(10 * POLL_S)
        first.stop()

        # A new proxy's forwarder goes on from the restored progress: only version 4 and its eval go out.
        second = start(fresh)
        _publish_with_record(fresh, submitted)
        put_eval(bucket, 4, {"pass@1": 0.75})
        wait_until(lambda: "trackio:eval:4" in _tracking(redis_client, fresh), "step 4 and its eval sent")
    finally:  # stopping finishes the trackio run (its rows are flushed); a failed check leaves no thread behind
        first.stop()
        if second is not None:
            second.stop()

    rows = trackio_logs(project, RUN)
    assert [row["step"] for row in rows if "reward" in row] == [1, 2, 3, 4]
    evals = [(row["step"], row["eval/pass@1"]) for row in rows if "eval/pass@1" in row]
    assert evals == [(0, 0.125), (2, 0.5), (4, 0.75)]


class _RecordingTracker(Tracker):
    """Remembers every step and eval it was sent, in order."""

    name = "recording"
    module = "json"

    def __init__(self) -> None:
        super().__init__(TrackerRun(project="p", name=RUN, config={}))
        self.sent: list[tuple[str, int]] = []

    def start(self) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.sent.append(("step", step))

    def log_eval(self, metrics: dict[str, float], step: int) -> None:
        self.sent.append(("eval", step))

    def finish(self) -> None:
        pass


def _follower(redis_client: Redis, bucket: Bucket, coord: Coordinator, tracker: Tracker) -> TrackerFollower:
    return TrackerFollower(
        tracker,
        redis=redis_client,
        bucket=bucket,
        run=RUN,
        metrics=TrackerMetrics(CollectorRegistry()),
        on_progress=coord.store.mark_changed,
        poll_s=POLL_S,
    )


def test_a_snapshot_older_than_the_last_send_never_moves_a_running_follower_back(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord = make_coordinator(redis_client, bucket, clock=clock)
    submitted: set[str] = set()
    coord.tick()
    publish_next(coord)
    for _ in range(2):
        _publish_with_record(coord, submitted)
    tracker = _RecordingTracker()
    follower = _follower(redis_client, bucket, coord, tracker)
    assert follower.forward_once() == 2
    coord.snapshots.write()  # the snapshot knows steps 1-2 were sent
    _publish_with_record(coord, submitted)
    assert follower.forward_once() == 1  # step 3: sent after the last snapshot put

    redis_client.flushall()
    assert follower.forward_once() == 0, "nothing is sent while Redis holds no state"
    fresh = _rebuilt(redis_client, bucket, clock)
    assert _tracking(redis_client, fresh)["recording:step"] == "2"  # the snapshot's, one step behind
    assert follower.forward_once() == 0
    assert _tracking(redis_client, fresh)["recording:step"] == "3", "the follower wrote its own cursor back"
    assert tracker.sent == [("step", 1), ("step", 2), ("step", 3)]

    # A proxy started now resumes from step 3: nothing again.
    again = _RecordingTracker()
    assert _follower(redis_client, bucket, fresh, again).forward_once() == 0 and again.sent == []


class _FlushingTracker(_RecordingTracker):
    """Redis empties while the tracker takes a step: the follower's progress write comes after the flush."""

    def __init__(self, redis_client: Redis) -> None:
        super().__init__()
        self.redis_client = redis_client

    def log(self, metrics: dict[str, float], step: int) -> None:
        super().log(metrics, step)
        self.redis_client.flushall()


def test_progress_written_after_redis_emptied_leaves_no_partial_state(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    """The follower found the state, then Redis emptied under it: its write of the step is refused, so Redis
    stays empty (a lone ``tracking`` or ``state`` field would read as a state the rebuild must not trust)."""
    coord = make_coordinator(redis_client, bucket, clock=clock)
    submitted: set[str] = set()
    coord.tick()
    publish_next(coord)
    _publish_with_record(coord, submitted)
    coord.snapshots.write()
    tracker = _FlushingTracker(redis_client)
    follower = _follower(redis_client, bucket, coord, tracker)
    assert follower.forward_once() == 0, "the round ends when its write is refused"
    assert tracker.sent == [("step", 1)]
    assert redis_client.dbsize() == 0, f"left behind: {sorted(redis_client.keys())}"
    with pytest.raises(StateMissing):
        coord.store.write_logged_field("state", "halt_check", "{}")
    assert redis_client.dbsize() == 0

    fresh = _rebuilt(redis_client, bucket, clock)
    assert follower.forward_once() == 0
    assert _tracking(redis_client, fresh)["recording:step"] == "1", "the follower's cursor, written back"
    assert tracker.sent == [("step", 1)]


def test_a_snapshot_without_tracking_progress_still_rebuilds(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    """A snapshot written before the field existed: the run rebuilds, the trackers start from the beginning."""
    coord = make_coordinator(redis_client, bucket, clock=clock)
    submitted: set[str] = set()
    coord.tick()
    publish_next(coord)
    _publish_with_record(coord, submitted)
    assert _follower(redis_client, bucket, coord, _RecordingTracker()).forward_once() == 1
    coord.snapshots.write()
    key = bucket_keys.proxy_snapshot_key(RUN)
    document: dict[str, Any] = json.loads(bucket.get(key))
    assert document.pop("tracking") == {"recording": {"step": 1, "evals": []}}
    document.pop("sha256")
    bucket.put(key, seal(json.dumps(document).encode()))

    redis_client.flushall()
    fresh = _rebuilt(redis_client, bucket, clock)
    assert fresh.current_version() == 1 and _tracking(redis_client, fresh) == {}
    tracker = _RecordingTracker()
    assert _follower(redis_client, bucket, fresh, tracker).forward_once() == 1 and tracker.sent == [("step", 1)]
