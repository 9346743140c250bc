"""A hypothesis state machine runs leases, submits, claims, publishes, clock jumps, proxy restarts, Redis losses,
broker refusals, bad submissions and two attempts at one step against the real coordinator (real Redis,
FileBucket, recording dispatcher) and the model of ``tests/support/protocol_model.py``, checking after every rule:

1. the version only moves by a publish of ``current + 1`` from a claimed step (one of two attempts wins);
   bad publishes change nothing; a rebuild never goes back;
2. every claimed batch is fresh: ``base - version <= max_staleness`` for each rollout;
3. versions under a live lease, and the versions of the staleness window, are in the bucket;
4. every dispatched group has exactly the fate the model gives it, none is trained twice, stale and
   cancelled prompts come back first and in order; a refused submission changes nothing.

Redis loss: the snapshot is the state of its last write (submits and publishes write through; ``tick()``
writes before sending and before deleting rollouts), so the model copies itself at each write and a rebuild
must give ``rebuilt(copy)``. Leases are not written through: one survives surely only if a write surely saw it.
"""

from __future__ import annotations

import copy
import uuid
from contextlib import suppress
from functools import partial
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from redis import Redis

from asyncgrpo.bucket.layout import list_versions
from asyncgrpo.protocol.schemas import StaleRolloutError
from proxy.coordinator.leases import live_leased_versions
from proxy.coordinator.scripts import (
    BadRollout,
    LeaseLostError,
    NotTaskHolder,
    NoVersionYet,
    PublishConflict,
    TaskCancelled,
    UnknownTask,
)
from proxy.coordinator.service import Coordinator
from tests.support.protocol_model import (
    NUM_PROMPTS,
    SEED,
    FlakyDispatcher,
    ModelState,
    bad_submission,
    rebuilt,
    upload_twice,
)
from tests.support.proxy_harness import (
    ManualClock,
    file_bucket,
    make_coordinator,
    publish_request,
    small_config,
    submission,
    write_fake_version,
)

TIMEOUT_S = 300


class ProtocolMachine(RuleBasedStateMachine):
    def __init__(self, redis_url: str, root: Path, max_staleness: int) -> None:
        super().__init__()
        self.max_staleness = max_staleness
        self.redis = Redis.from_url(redis_url, decode_responses=True)
        self.redis.flushdb()
        self.clock = ManualClock()
        self.config = small_config(
            seed=SEED,
            max_staleness=max_staleness,
            groups_per_task=2,
            groups_per_step=4,
            queue_maxsize=8,
            lease_ttl_s=60,
            generate_task_timeout_s=TIMEOUT_S,
        )
        self.resend_ms = int(self.config.async_.optimize_task_timeout_s * 1000)
        self.bucket = file_bucket(root / uuid.uuid4().hex)
        self.dispatcher = FlakyDispatcher()
        kwargs = {"config": self.config, "num_prompts": NUM_PROMPTS, "clock": self.clock, "dispatcher": self.dispatcher}
        self._new_coordinator = partial(make_coordinator, self.redis, self.bucket, **kwargs)
        self.coord: Coordinator = self._new_coordinator()
        self.needed = 4
        self.m = ModelState()
        self.snap = ModelState()  # the model as of the coordinator's last snapshot write
        self.leases: dict[str, tuple[int, int]] = {}  # lease id -> (version, expires_ms), known to be live
        self.maybe_leases: dict[str, int] = {}  # lease id -> version: a rebuild may or may not have kept it
        self.snap_leases: dict[str, tuple[int, int]] = {}  # the leases a snapshot write surely saw
        self.fresh_writer = True  # a new coordinator's first tick always writes the snapshot
        self.seen = {"generate": 0, "optimize": 0, "refused_generate": 0, "refused_optimize": 0}
        # Submissions are bound to their lease: the versions gen-1 leased for each task, the version each task
        # was admitted with, and the tasks admitted since Redis was last lost (a rebuild keeps no holder for
        # the tasks of a claimed step, so a repeat of those is not checked against anything).
        self.task_leases: dict[str, set[int]] = {}
        self.task_leased_ms: dict[str, int] = {}  # gen-1 (which sends no heartbeat) last leased the task then
        self.lease_task_of: dict[str, str] = {}  # lease id -> the task in flight it was leased for
        self.admitted_version: dict[str, int] = {}
        self.bound: set[str] = set()

    def teardown(self) -> None:
        self.redis.close()

    def _new(self, kind: str) -> list[dict]:
        messages = getattr(self.dispatcher, kind)[self.seen[kind] :]
        self.seen[kind] += len(messages)
        return messages

    def _durable(self, *, leases_seen: bool) -> None:
        """A snapshot write happened now; ``leases_seen``: surely now (else the leases may be older)."""
        self.snap = copy.deepcopy(self.m)
        if leases_seen:
            self.snap_leases = dict(self.leases)

    # ---- rules ----

    @rule()
    def tick(self) -> None:
        m, now = self.m, self.clock()
        self.leases = {k: v for k, v in self.leases.items() if v[1] > now}
        changed = m.expire(now, self.config.async_.max_group_attempts) > 0 or self.fresh_writer
        # Invariant 8: a task whose holder was leased it longer ago than a heartbeat may be missed goes too.
        silent_since = now - int(self.coord.heartbeats.alive_s * 1000)
        lost = [t for t in m.inflight_tasks() if self.task_leased_ms.get(t, now) <= silent_since]
        m.cancel_counted(lost, self.config.async_.max_group_attempts)
        changed = changed or bool(lost)
        self.fresh_writer = False
        before = m.step_inflight
        due = before is not None and (m.step_sent_ms is None or now - m.step_sent_ms > self.resend_ms)
        changed = m.drop_stale(self.max_staleness) > 0 or changed

        report = self.coord.tick()

        sent_steps, refused_steps = self._new("optimize"), self._new("refused_optimize")
        steps = sent_steps + refused_steps
        assert len(steps) == int(due) if before is not None else len(steps) <= 1, "one send when due"
        for message in steps:
            if message["step"] in m.batches:
                assert due and message == m.batches[before], "a re-sent step carries the same batch"
            else:
                m.claim(message, self.max_staleness, self.needed)
                changed = True
        if sent_steps:
            m.step_sent_ms = now
        sent, refused = self._new("generate"), self._new("refused_generate")
        assert not (sent and refused), "the broker refused this tick's sends, or none"
        for message in sent + refused:
            m.dispatched(message, now + TIMEOUT_S * 1000)
        self._durable(leases_seen=changed or bool(sent or refused))  # written before anything is sent
        for message in refused:  # never sent: cancelled at once, no attempt counted
            m.force_cancel(message["task_id"])
        if report.rollouts_deleted:
            self._durable(leases_seen=True)  # written again before rollout objects are deleted
        m.check_liveness(self.needed, self.config.async_.queue_maxsize, self.coord.pacer.limit())

    @rule()
    def tick_while_the_broker_refuses(self) -> None:
        self.dispatcher.fail = True
        try:
            self.tick()
        finally:
            self.dispatcher.fail = False

    @rule(seconds=st.sampled_from([1, 20, 61, TIMEOUT_S + 1]))
    def advance_clock(self, seconds: int) -> None:
        self.clock.advance(seconds)

    @initialize()
    def start_the_run(self) -> None:
        """Init step, version 0, generate tasks in flight: most examples should get to the interesting part."""
        self.tick()
        self.publish_claimed_step()
        self.tick()

    @rule(data=st.data(), lag=st.integers(0, 3), reject_first=st.booleans())
    def submit(self, data: st.DataObject, lag: int, reject_first: bool) -> None:
        if not self.m.task_state:
            return
        self._submit(data.draw(st.sampled_from(sorted(self.m.task_state))), lag, reject_first)

    @rule(lag=st.integers(0, 2))
    def submit_every_task_in_flight(self, lag: int) -> None:
        for tid in sorted(t for t, state in self.m.task_state.items() if state == "inflight"):
            self._submit(tid, lag, reject_first=False)

    def _lease_task(self, tid: str) -> set[int]:
        """gen-1 leases the current version for a task in flight (as before it samples); its leased versions."""
        grant = self.coord.lease("gen-1", tid)
        assert grant.version == self.m.current
        self.leases[grant.lease_id] = (grant.version, int(grant.expires_at * 1000))
        self.task_leases.setdefault(tid, set()).add(grant.version)
        self.task_leased_ms[tid] = self.clock()
        self.lease_task_of[grant.lease_id] = tid
        return self.task_leases[tid]

    @rule(data=st.data())
    def lease_task(self, data: st.DataObject) -> None:
        inflight = sorted(t for t, state in self.m.task_state.items() if state == "inflight")
        if inflight:
            self._lease_task(data.draw(st.sampled_from(inflight)))

    def _submit(self, tid: str, lag: int, reject_first: bool) -> None:
        m = self.m
        state = m.task_state[tid]
        version = max(0, m.current - lag)
        if state == "inflight":  # a version gen-1 leased for it: the one nearest to ``lag`` behind
            leased = self.task_leases.get(tid) or self._lease_task(tid)
            version = min(leased, key=lambda v: (abs(v - version), -v))
        elif state == "admitted":
            version = self.admitted_version.get(tid, version)
        rejected = {m.task_groups[tid][0]: "bad_prompt"} if reject_first else {}
        sub = submission(self.coord, m.task(tid), version, rejected=rejected, lease=False)
        if state in ("cancelled", "unknown"):
            with pytest.raises(TaskCancelled) as refused:
                self.coord.submit(sub)
            assert refused.type is (UnknownTask if state == "unknown" else TaskCancelled)
            return
        if state == "stale":
            with pytest.raises(StaleRolloutError):
                self.coord.submit(sub)
        elif state == "admitted":
            assert self.coord.submit(sub).status == "duplicate"
        elif m.current - version > self.max_staleness:
            m.ran(tid)
            with pytest.raises(StaleRolloutError):
                self.coord.submit(sub)
            m.task_state[tid] = "stale"
            for gid in m.task_groups[tid]:
                m.end(gid, "rejected" if gid in rejected else "stale")
        else:
            m.ran(tid)
            assert self.coord.submit(sub).status == "admitted"
            m.task_state[tid] = "admitted"
            self.admitted_version[tid] = version
            self.bound.add(tid)
            kept = [gid for gid in m.task_groups[tid] if gid not in rejected]
            for gid in m.task_groups[tid]:
                m.group_state[gid] = "rejected" if gid in rejected else "buffered"
            if kept:
                m.buffer.append(tid)
                m.rollout_version[tid] = version
                m.rollout_groups[tid] = kept
        self._durable(leases_seen=True)  # written through before the answer

    @rule(data=st.data(), kind=st.sampled_from(["key", "foreign_group", "twice", "future", "unknown_task"]))
    def submit_bad(self, data: st.DataObject, kind: str) -> None:
        """Refused with its exception, and nothing changes: no fate, counter, line or snapshot."""
        m = self.m
        inflight = sorted(t for t, s in m.task_state.items() if s == "inflight")
        tids = inflight if kind in ("foreign_group", "twice", "future") else sorted(m.task_state)
        if not tids:
            return
        tid = data.draw(st.sampled_from(tids))
        version = max(0, m.current)
        if m.task_state[tid] == "inflight":
            version = max(self.task_leases.get(tid) or self._lease_task(tid))
        sub = submission(self.coord, m.task(tid), version, lease=False)
        if kind == "unknown_task":
            sub, expected = submission(self.coord, m.task(tid) | {"task_id": tid + "-never"}, 0), UnknownTask
        else:
            others = sorted(g for g in m.group_state if g not in sub.group_ids) or ["nobody.0"]
            sub, expected = bad_submission(sub, kind, data.draw(st.sampled_from(others)), m.current), BadRollout
        before = (self.coord.status().counters, self._records(), self.coord.snapshots.writes)
        with pytest.raises(expected):
            self.coord.submit(sub)
        assert (self.coord.status().counters, self._records(), self.coord.snapshots.writes) == before

    @rule(data=st.data(), kind=st.sampled_from(["other_worker", "unleased_version", "foreign_lease", "other_sha"]))
    def submit_unbound(self, data: st.DataObject, kind: str) -> None:
        """Not from the task's holder, not a version or lease it leased for it, or not the admitted rollout:
        refused as NotTaskHolder, and nothing changes."""
        m = self.m
        inflight = sorted(t for t, s in m.task_state.items() if s == "inflight")
        admitted = sorted(self.bound & {t for t, s in m.task_state.items() if s == "admitted"})
        tids = {"other_worker": inflight + admitted, "other_sha": admitted}.get(kind, inflight)
        if not tids:
            return
        tid = data.draw(st.sampled_from(tids))
        leased = self.task_leases.get(tid) or (self._lease_task(tid) if tid in inflight else set())
        version = self.admitted_version[tid] if tid in admitted else max(leased)
        sub = submission(self.coord, m.task(tid), version, lease=False)
        if kind == "other_worker":
            sub = sub.model_copy(update={"worker_id": "gen-2"})
        elif kind == "unleased_version":
            unleased = sorted(set(range(m.current + 1)) - leased)
            if not unleased:
                return
            sub = sub.model_copy(update={"version": data.draw(st.sampled_from(unleased))})
        elif kind == "foreign_lease":
            sub = sub.model_copy(update={"lease_id": "f" * 32})
        else:
            sub = sub.model_copy(update={"sha256": "e" * 64})
        before = (self.coord.status().counters, self._records(), self.coord.snapshots.writes, self._lease_ids())
        with pytest.raises(NotTaskHolder):
            self.coord.submit(sub)
        assert (self.coord.status().counters, self._records(), self.coord.snapshots.writes, self._lease_ids()) == before

    def _lease_ids(self) -> list[str]:
        return self.redis.zrange(self.coord.keys.leases, 0, -1)

    def _records(self) -> list[str | None]:
        pipe = self.redis.pipeline(transaction=False)
        for gid in sorted(self.m.group_state):
            pipe.hget(self.coord.keys.group(gid), "state")
        return [*pipe.execute(), *self.redis.lrange(self.coord.keys.requeue, 0, -1)]

    def _published(self, version: int) -> None:
        m = self.m
        for ref in m.batches[version]["rollouts"]:
            for gid in ref["group_ids"]:
                assert m.group_state[gid] == "claimed", "trained at most once"
                m.group_state[gid] = "trained"
        m.current, m.step_inflight, m.step_sent_ms = version, None, None
        self._durable(leases_seen=True)  # written through before the answer

    @rule()
    def publish_claimed_step(self) -> None:
        if self.m.step_inflight is None:
            return
        version = self.m.step_inflight
        sha = write_fake_version(self.bucket, "r1", version)
        assert self.coord.publish(publish_request(version, sha)).current_version == version
        self._published(version)

    @rule(same_worker=st.booleans(), second_first=st.booleans(), borrowed=st.booleans())
    def two_attempts_publish(self, same_worker: bool, second_first: bool, borrowed: bool) -> None:
        """Two uploads of the step in flight: one manifest per version, exactly one publish wins."""
        version = self.m.step_inflight
        if version is None:
            return
        requests = upload_twice(self.bucket, version, same_worker, second_first, borrowed)
        answers = []
        for request in requests:
            try:
                answers.append(self.coord.publish(request).current_version)
            except PublishConflict as conflict:  # CasLost, or ManifestMismatch for a manifest that lost
                assert not same_worker and conflict.current_version in (version - 1, version)
        assert answers == [version] * (2 if same_worker else 1), "exactly one attempt publishes (a retry: ALREADY)"
        self._published(version)

    @rule(kind=st.sampled_from(["zombie", "skip_ahead", "missing_manifest"]))
    def publish_wrong(self, kind: str) -> None:
        current = self.m.current
        if kind == "zombie" and current >= 0:
            # A second trainer that also finished the step that made the current version.
            sha = self.coord.redis.hget(self.coord.keys.versions, str(current))
            request = publish_request(current, sha, worker_id="zombie")
        elif kind == "skip_ahead":
            request = publish_request(current + 2, "d" * 64).model_copy(update={"base_version": current})
        else:
            request = publish_request(current + 1, "e" * 64)
        with pytest.raises(PublishConflict):
            self.coord.publish(request)

    @rule()
    def lease(self) -> None:
        if self.m.current < 0:
            with pytest.raises(NoVersionYet):
                self.coord.lease("gen-1", "t")
            return
        grant = self.coord.lease("gen-1", "t")
        assert grant.version == self.m.current
        self.leases[grant.lease_id] = (grant.version, int(grant.expires_at * 1000))

    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        ids = [*self.leases, *self.maybe_leases]  # insertion order: lease ids are random
        if not ids:
            return
        lease_id = data.draw(st.sampled_from(ids))
        if lease_id in self.maybe_leases:  # kept by a rebuild or not: either answer is right
            version = self.maybe_leases.pop(lease_id)
            with suppress(LeaseLostError):
                grant = self.coord.renew(lease_id)
                assert grant.version == version
                self.leases[lease_id] = (version, int(grant.expires_at * 1000))
            return
        version, expires = self.leases[lease_id]
        if expires > self.clock():
            grant = self.coord.renew(lease_id)
            assert grant.version == version
            self.leases[lease_id] = (version, int(grant.expires_at * 1000))
        else:
            with pytest.raises(LeaseLostError):
                self.coord.renew(lease_id)
            del self.leases[lease_id]

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        ids = [*self.leases, *self.maybe_leases]
        if not ids:
            return
        lease_id = data.draw(st.sampled_from(ids))
        self.coord.release(lease_id)
        self.leases.pop(lease_id, None)
        surely_live = self.maybe_leases.pop(lease_id, None) is None
        # The worker's own release ends its hold on the task once no other lease of it is live: its silence
        # then cancels nothing (the task's deadline still does). A lease a rebuild may have kept leaves the
        # answer open: either is right, so the model takes the store's.
        tid = self.lease_task_of.pop(lease_id, None)
        if tid is None or self.m.task_state.get(tid) != "inflight":
            return
        others = {k for k, t in self.lease_task_of.items() if t == tid}
        if not surely_live or others & set(self.maybe_leases):
            ended = self.redis.hget(self.coord.store.keys.task(tid), "worker_id") is None
        else:
            ended = not others & set(self.leases)
        if ended:  # handed back: a worker leases it afresh before it submits
            self.task_leased_ms.pop(tid, None)
            self.task_leases.pop(tid, None)

    @rule()
    def restart_proxy(self) -> None:
        """A new proxy process on the same Redis: nothing lives only in the old one's memory."""
        self.coord = self._new_coordinator()
        self.fresh_writer = True

    @rule()
    def lose_redis(self) -> None:
        """Redis loses everything and a new proxy rebuilds the run from the bucket's snapshot."""
        self.redis.flushdb()
        self.coord = self._new_coordinator()
        assert self.coord.ensure_state() == "rebuilt"
        now = self.clock()
        self.m = rebuilt(self.snap)
        surely = {k: v for k, v in self.leases.items() if self.snap_leases.get(k) == v and v[1] > now}
        self.maybe_leases.update({k: v[0] for k, v in self.leases.items() if k not in surely})
        self.leases = surely
        assert {v for v, _ in surely.values()} <= live_leased_versions(self.coord.store), "a snapshot's lease kept"
        self.bound.clear()
        self.fresh_writer = True

    # ---- invariants ----

    @invariant()
    def version_matches_the_model(self) -> None:
        assert self.coord.current_version() == self.m.current

    @invariant()
    def leased_and_window_versions_exist(self) -> None:
        current = self.m.current
        if current < 0:
            return
        present = set(list_versions(self.bucket, "r1"))
        now = self.clock()
        leased = {v for v, expires in self.leases.values() if expires > now}
        window = set(range(max(0, current - self.max_staleness - 1), current + 1))
        assert leased | window <= present, (leased, window, present)

    @invariant()
    def every_group_has_its_one_fate(self) -> None:
        m = self.m
        gids = sorted(m.group_state)
        records = self._records()
        for gid, state in zip(gids, records, strict=False):
            expected = None if gid in m.forgotten else m.group_state[gid]
            assert state == expected, (gid, state, expected)
        assert records[len(gids) :] == [str(p) for p in m.requeue]
        status = self.coord.status()
        assert status.groups_inflight == m.count("inflight")
        assert status.groups_buffered == m.count("buffered")
        assert status.step_inflight == m.step_inflight
        counters = status.counters
        for fate in ("trained", "stale", "cancelled", "rejected"):
            assert counters.get(f"groups_{fate}", 0) == m.count(fate), fate
        attempts = self.redis.hgetall(self.coord.keys.prompt_attempts)
        assert {int(p): int(n) for p, n in attempts.items() if p.isdigit()} == m.attempts
        assert {int(p.split(":")[1]) for p in attempts if p.startswith("quarantined:")} == m.quarantined


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_protocol_against_the_model(redis_url: str, tmp_path: Path, max_staleness: int) -> None:
    run_state_machine_as_test(
        lambda: ProtocolMachine(redis_url, tmp_path, max_staleness),
        settings=settings(
            max_examples=25,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
