"""The snapshot log (``proxy.coordinator.snapshot_log``) on a real Redis and a real bucket: the snapshot plus its
segments equal the state, after every operation of a randomized busy run; rebuilds read snapshot + log,
including a crash between a segment and its compaction; every script write is noted.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.protocol.errors import ProxyError
from asyncgrpo.protocol.schemas import HeartbeatRequest, StaleRolloutError, StepFailureReport, TaskFailureReport
from proxy.coordinator.redis_store import LOGGED_KEYS, tracking_eval_field, tracking_step_field
from proxy.coordinator.scripts import ALL_SCRIPTS, CoordinatorError, lua_text
from proxy.coordinator.service import Coordinator
from proxy.coordinator.snapshot import load_snapshot, load_stored_state, read_state_document
from proxy.coordinator.snapshot_log import CompactionPolicy, Replay, state_sections
from tests.support.proxy_harness import (
    ManualClock,
    file_bucket,
    make_coordinator,
    publish_next,
    small_config,
    submission,
)

NEVER = CompactionPolicy(max_segments=10**9, log_to_snapshot=float("inf"))


@pytest.fixture
def bucket(tmp_path: Path) -> Bucket:
    return file_bucket(tmp_path)


def bucket_state(bucket: Bucket, run: str) -> dict:
    document = load_snapshot(bucket, run)
    assert document is not None
    return state_sections(document)


def redis_state(coord: Coordinator) -> dict:
    document = read_state_document(coord.store)
    assert document is not None
    return state_sections(document)


class BusyRun:
    """A coordinator driven by random operations, as a fleet of workers and a trainer would."""

    def __init__(self, coord: Coordinator, clock: ManualClock, seed: int) -> None:
        self.coord = coord
        self.clock = clock
        self.rng = random.Random(seed)
        self.leases: list[str] = []
        self.held: dict[str, int] = {}  # task id -> the version its worker leased
        self.refused = 0

    def inflight(self) -> list[dict]:
        ids = set(self.coord.redis.zrange(self.coord.keys.tasks_inflight, 0, -1))
        return [task for task in self.coord.dispatcher.generate if task["task_id"] in ids]

    def step(self) -> str:
        coord, rng = self.coord, self.rng
        operations = [
            self.tick,
            self.lease,
            self.lease,
            self.submit,
            self.submit,
            self.submit,
            self.renew,
            self.release,
            self.publish,
            self.fail_step,
            self.fail_task,
            self.heartbeat,
            self.track,
            self.wait,
        ]
        operation = rng.choice(operations)
        try:
            operation()
        except (CoordinatorError, ProxyError, StaleRolloutError):
            self.refused += 1  # a refusal is an answer too: whatever it changed must be in the log
        coord.store.mark_changed()
        return operation.__name__

    def tick(self) -> None:
        self.coord.tick()

    def lease(self) -> None:
        tasks = self.inflight()
        if tasks:
            task = self.rng.choice(tasks)
            grant = self.coord.lease(f"gen-{self.rng.randrange(4)}", task["task_id"])
            self.leases.append(grant.lease_id)

    def submit(self) -> None:
        tasks = self.inflight()
        if not tasks:
            return
        task = self.rng.choice(tasks)
        groups = [g["group_id"] for g in task["groups"]]
        rejected = {groups[0]: "bad_format"} if len(groups) > 1 and self.rng.random() < 0.2 else None
        self.coord.submit(submission(self.coord, task, self.coord.current_version(), rejected=rejected))

    def renew(self) -> None:
        if self.leases:
            self.coord.renew(self.rng.choice(self.leases))

    def release(self) -> None:
        if self.leases:
            self.coord.release(self.leases.pop(self.rng.randrange(len(self.leases))))

    def publish(self) -> None:
        if self.coord.status().step_inflight is not None:
            publish_next(self.coord)

    def fail_step(self) -> None:
        step = self.coord.status().step_inflight
        if step is None:
            return
        batch = self.coord.get_step(step)
        kind = self.rng.choice(["rollout", "step", "base"])
        task_id = batch.rollouts[0].task_id if kind == "rollout" and batch.rollouts else None
        if kind == "rollout" and task_id is None:
            return
        report = StepFailureReport(worker_id="trainer-1", kind=kind, reason="broken", task_id=task_id)
        self.coord.report_step_failure(step, report)

    def fail_task(self) -> None:
        tasks = self.inflight()
        if tasks:
            task = self.rng.choice(tasks)
            worker = self.coord.redis.hget(self.coord.keys.task(task["task_id"]), "worker_id") or "gen-0"
            self.coord.report_task_failure(task["task_id"], TaskFailureReport(worker_id=worker, reason="oom"))

    def heartbeat(self) -> None:
        worker = f"gen-{self.rng.randrange(4)}"
        incarnation = f"i{self.rng.randrange(3)}"  # now and then a new one: the old one's leases end
        report = HeartbeatRequest(
            worker_id=worker, role="generate", hostname="h", pid=1, incarnation=incarnation, state="idle"
        )
        self.coord.heartbeat(report)

    def track(self) -> None:
        tracker = self.rng.choice(["wandb", "mlflow"])
        store = self.coord.store
        if self.rng.random() < 0.5:
            store.write_logged_field("tracking", tracking_step_field(tracker), self.rng.randrange(10))
        else:
            field = tracking_eval_field(tracker, self.rng.randrange(10))
            store.write_logged_field("tracking", field, self.rng.randrange(10**9))

    def wait(self) -> None:
        self.clock.advance(self.rng.choice([1, 5, 30, 200]))  # past deadlines now and then: tasks cancelled


def busy(redis_client: Redis, bucket: Bucket, seed: int) -> BusyRun:
    clock = ManualClock()
    config = small_config(groups_per_task=2, groups_per_step=4, queue_maxsize=12, max_staleness=1)
    coord = make_coordinator(redis_client, bucket, config=config, num_prompts=40, clock=clock)
    coord.tick()
    publish_next(coord)
    return BusyRun(coord, clock, seed)


def logged(redis_client: Redis, bucket: Bucket, seed: int, operations: int) -> BusyRun:
    """A busy run of ``operations`` random operations, each made durable by a segment (no compaction after the
    first)."""
    run = busy(redis_client, bucket, seed)
    run.coord.snapshots.policy = NEVER
    for _ in range(operations):
        run.step()
        run.coord.snapshots.write(force=True)
    return run


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", ["segments_only", "default"])
def test_the_snapshot_and_its_log_equal_the_state_after_every_operation(
    redis_client: Redis, bucket: Bucket, seed: int, policy: str
) -> None:
    run = busy(redis_client, bucket, seed)
    writer = run.coord.snapshots
    writer.policy = NEVER if policy == "segments_only" else CompactionPolicy()
    done: dict[str, int] = {}
    for n in range(150):
        name = run.step()
        done[name] = done.get(name, 0) + 1
        writer.write()
        assert bucket_state(bucket, run.coord.run) == redis_state(run.coord), f"after operation {n} ({name})"
    stored = load_stored_state(bucket, run.coord.run)
    counters = redis_state(run.coord)["counters"]
    # The run was busy: every kind of change happened, and the log carried it.
    assert int(counters.get("groups_admitted", 0)) > 10 and int(counters.get("publish", 0)) >= 3, counters
    assert int(counters.get("groups_cancelled", 0)) + int(counters.get("groups_stale", 0)) > 0, counters
    assert all(done.get(name, 0) > 0 for name in ("submit", "publish", "fail_step", "wait", "heartbeat", "track"))
    if policy == "segments_only":
        assert writer.compactions == 1 and stored.segments > 100
    else:
        assert writer.compactions > 1, "the default policy compacted as the log grew"


def test_each_segment_holds_only_what_changed(redis_client: Redis, bucket: Bucket) -> None:
    """The bytes a commit puts do not grow with the tasks in flight: a submit's segment is the same size with 6
    tasks in flight as with 60."""
    sizes = []
    for tasks in (6, 60):
        redis_client.flushall()
        clock = ManualClock()
        config = small_config(groups_per_task=1, groups_per_step=tasks, queue_maxsize=tasks)
        coord = make_coordinator(redis_client, bucket, config=config, num_prompts=200, clock=clock, run=f"r{tasks}")
        coord.snapshots.policy = NEVER
        coord.tick()
        publish_next(coord)
        coord.tick()
        assert len(coord.dispatcher.generate) == tasks
        for task in coord.dispatcher.generate[:-1]:
            coord.submit(submission(coord, task, 0))
        before = coord.snapshots.put_bytes
        coord.submit(submission(coord, coord.dispatcher.generate[-1], 0))
        sizes.append(coord.snapshots.put_bytes - before)
        snapshot = len(bucket.get(bucket_keys.proxy_snapshot_key(coord.run)))
        assert sizes[-1] < 4000, f"a submit's segment is {sizes[-1]} bytes (the snapshot: {snapshot})"
    assert abs(sizes[1] - sizes[0]) < 200, sizes


def test_rebuild_after_a_crash_between_segments_and_their_compaction(redis_client: Redis, bucket: Bucket) -> None:
    """Segments above the snapshot, no compaction since (the proxy died), Redis emptied: the rebuild reads the
    snapshot and applies every segment, so no admitted rollout is lost, and the log goes on above them."""
    run = logged(redis_client, bucket, seed=7, operations=60)
    buffered = redis_client.lrange(run.coord.keys.buffer, 0, -1)
    version = run.coord.current_version()
    stored = load_stored_state(bucket, run.coord.run)
    assert stored.segments > 20 and buffered, "segments above the snapshot, rollouts buffered"
    last = stored.last_seq
    redis_client.flushall()
    fresh = make_coordinator(redis_client, bucket, config=run.coord.config, num_prompts=40, clock=run.clock)
    assert fresh.ensure_state() == "rebuilt"
    assert redis_client.lrange(fresh.keys.buffer, 0, -1) == buffered, "no admitted rollout lost"
    assert fresh.current_version() == version
    assert int(redis_client.hget(fresh.keys.log, "seq")) == last, "numbered above every segment in the bucket"
    fresh.snapshots.write(force=True)  # a rebuilt state is compacted first
    assert fresh.snapshots.compactions == 1
    assert json.loads(bucket.get(bucket_keys.proxy_snapshot_key(fresh.run)))["log_through"] == last + 1
    assert bucket.list(bucket_keys.proxy_log_prefix(fresh.run)) == [], "the compaction collected the log"
    fresh.store.mark_changed()
    fresh.tick()
    assert bucket_state(bucket, fresh.run) == redis_state(fresh)


def test_a_missing_segment_is_refused_naming_it(redis_client: Redis, bucket: Bucket) -> None:
    from proxy.coordinator.snapshot import SnapshotCorrupt

    run = logged(redis_client, bucket, seed=3, operations=12)
    keys = bucket.list(bucket_keys.proxy_log_prefix(run.coord.run))
    assert len(keys) >= 3
    bucket.delete(keys[1])
    with pytest.raises(SnapshotCorrupt, match=re.escape(keys[1]) + " is missing"):
        load_snapshot(bucket, run.coord.run)


def test_a_corrupted_segment_is_refused_naming_it(redis_client: Redis, bucket: Bucket) -> None:
    from proxy.coordinator.snapshot import SnapshotCorrupt

    run = logged(redis_client, bucket, seed=4, operations=4)
    key = bucket.list(bucket_keys.proxy_log_prefix(run.coord.run))[-1]
    bucket.put(key, bucket.get(key).replace(b'"seq":', b'"seq": ', 1))
    with pytest.raises(SnapshotCorrupt, match=re.escape(key) + " fails its checksum"):
        load_snapshot(bucket, run.coord.run)


def test_every_script_write_to_the_state_goes_through_call() -> None:
    """A write made with redis.call would change the state without a note, and the log would silently miss it."""
    writes = "HSET|HINCRBY|HDEL|DEL|RPUSH|LPUSH|LPOP|RPOP|LREM|LSET|LTRIM|ZADD|ZREM|ZREMRANGEBYSCORE|ZPOPMIN|SET"
    exempt = {"snapshot_json", "log_segment", "restore_state"}  # the log's own keys, and a whole-state restore
    found = []
    for script in ALL_SCRIPTS:
        if script.name in exempt:
            continue
        found += [f"{script.name}: {m}" for m in re.findall(rf"redis\.call\('(?:{writes})'", lua_text(script.name))]
    assert found == []


def test_a_write_the_log_cannot_replay_is_refused_before_it_happens(redis_client: Redis) -> None:
    from string import Template

    from proxy.coordinator.redis_store import prelude_names

    prelude = Template(lua_text("prelude")).substitute(prelude_names())
    body = prelude + "\ncall('RPOP', PREFIX .. 'buffer')\nreturn 1"
    redis_client.rpush("asyncgrpo:{r1}:buffer", "t1")
    with pytest.raises(Exception, match="RPOP on buffer is not one the snapshot log replays"):
        redis_client.eval(body, 0, "asyncgrpo:{r1}:")
    assert redis_client.lrange("asyncgrpo:{r1}:buffer", 0, -1) == ["t1"]


def test_logged_keys_are_the_documents_sections() -> None:
    empty = {
        "state": {"step_inflight": "-1"},
        "counters": {},
        "rejected_reasons": {},
        "versions": {},
        "requeue": [],
        "buffer": [],
        "inflight_tasks": [],
        "step": None,
        "leases": [],
        "rollout_retention": {},
        "prompt_attempts": {},
        "tracking": {},
    }
    sections = set(Replay(empty).document())
    named = {"tasks_inflight": "inflight_tasks"}
    assert {named.get(name, name) for name in LOGGED_KEYS} == sections - {"step"}


def test_a_reader_racing_a_compaction_reads_again(redis_client: Redis, bucket: Bucket) -> None:
    """A reader beside a live proxy (a benchmark's audit, an operator's tool) lists segments that a compaction
    then deletes: it finds the snapshot moved on and reads again, never a half-applied or refused log."""
    run = logged(redis_client, bucket, seed=5, operations=10)
    writer = run.coord.snapshots
    prefix = bucket_keys.proxy_log_prefix(run.coord.run)
    listings: list[list[str]] = []

    class CompactsAfterListing:
        def __init__(self, inner: Bucket) -> None:
            self.inner = inner

        def list(self, at: str) -> list[str]:
            keys = self.inner.list(at)
            if at == prefix:
                listings.append(keys)
                if len(listings) == 1:  # the proxy compacts right after the reader listed the log
                    writer.policy = CompactionPolicy(max_segments=0)
                    writer.write(force=True)
            return keys

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    stored = load_stored_state(CompactsAfterListing(bucket), run.coord.run)  # type: ignore[arg-type]
    assert len(listings) == 2 and listings[0] and listings[1] == [], "read again after the compaction"
    assert stored.document is not None and state_sections(stored.document) == redis_state(run.coord)
