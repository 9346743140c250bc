"""A hypothesis state machine runs leases, submits, claims, publishes and clock jumps against the real
coordinator (real Redis, FileBucket, recording dispatcher) and a small in-memory model of the protocol, and
checks invariants 1-4 after every rule:

1. the current version only moves by a publish of ``current + 1`` from a claimed step; bad publishes
   change nothing;
2. every claimed batch is fresh: ``base - version <= max_staleness`` for each rollout;
3. versions under a live lease, and the versions of the staleness window, are in the bucket;
4. every dispatched group has exactly the fate the model gives it, terminal fates never change, no group
   is trained twice, stale and cancelled prompts come back first and in order, nothing else does.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from redis import Redis

from proxy.coordinator.errors import LeaseLostError, NoVersionYet, PublishConflict, TaskCancelled
from proxy.coordinator.service import Coordinator
from proxy.protocol.staleness import StaleRolloutError
from proxy.storage.manifest import list_versions
from tests.proxy_harness import (
    ManualClock,
    file_bucket,
    make_coordinator,
    publish_request,
    small_config,
    submission,
    write_fake_version,
)

TIMEOUT_S = 300
NUM_PROMPTS = 7


class ProtocolMachine(RuleBasedStateMachine):
    def __init__(self, redis_url: str, root: Path, max_staleness: int) -> None:
        super().__init__()
        self.max_staleness = max_staleness
        self.redis = Redis.from_url(redis_url, decode_responses=True)
        self.redis.flushdb()
        self.clock = ManualClock()
        self.config = small_config(
            seed=3,
            max_staleness=max_staleness,
            groups_per_task=2,
            groups_per_step=4,
            queue_maxsize=8,
            lease_ttl_s=60,
            generate_task_timeout_s=TIMEOUT_S,
        )
        self.bucket = file_bucket(root / uuid.uuid4().hex)
        self.coord = self._new_coordinator()
        self.needed = 4
        # the model
        self.current = -1
        self.group_state: dict[str, str] = {}
        self.group_prompt: dict[str, int] = {}
        self.task_groups: dict[str, list[str]] = {}
        self.task_state: dict[str, str] = {}
        self.task_deadline: dict[str, int] = {}
        self.rollout_version: dict[str, int] = {}
        self.rollout_groups: dict[str, list[str]] = {}
        self.buffer: list[str] = []
        self.requeue: list[int] = []
        self.leases: dict[str, tuple[int, int]] = {}
        self.batches: dict[int, dict] = {}
        self.step_inflight: int | None = None
        self.seen_generate = 0
        self.seen_optimize = 0
        self.epoch, self.pos = 0, 0

    def _new_coordinator(self) -> Coordinator:
        return make_coordinator(self.redis, self.bucket, config=self.config, num_prompts=NUM_PROMPTS, clock=self.clock)

    def teardown(self) -> None:
        self.redis.close()

    # ---- model helpers ----

    def _next_fresh_prompt(self) -> int:
        perm = list(range(NUM_PROMPTS))
        random.Random(3 + self.epoch).shuffle(perm)
        prompt = perm[self.pos]
        self.pos += 1
        if self.pos == NUM_PROMPTS:
            self.epoch, self.pos = self.epoch + 1, 0
        return prompt

    def _end(self, gid: str, fate: str) -> None:
        self.group_state[gid] = fate
        if fate in ("stale", "cancelled"):
            self.requeue.append(self.group_prompt[gid])

    def _count(self, state: str) -> int:
        return sum(1 for s in self.group_state.values() if s == state)

    # ---- rules ----

    @rule()
    def tick(self) -> None:
        now = self.clock()
        self.leases = {k: v for k, v in self.leases.items() if v[1] > now}
        due = sorted(
            (self.task_deadline[t], t)
            for t, s in self.task_state.items()
            if s == "inflight" and self.task_deadline[t] <= now
        )
        for _, tid in due:
            self.task_state[tid] = "cancelled"
            for gid in self.task_groups[tid]:
                self._end(gid, "cancelled")
        if self.step_inflight is None and self.current >= 0:
            for tid in list(self.buffer):
                if self.current - self.rollout_version[tid] > self.max_staleness:
                    self.buffer.remove(tid)
                    for gid in self.rollout_groups[tid]:
                        self._end(gid, "stale")

        self.coord.tick()

        for message in self.coord.dispatcher.optimize[self.seen_optimize :]:
            step = message["step"]
            if step in self.batches:
                assert message == self.batches[step], "a re-sent step carries the same batch"
                continue
            assert step == self.current + 1 and message["base_version"] == self.current
            assert self.step_inflight is None, "one step in flight at a time"
            claimed = [ref["task_id"] for ref in message["rollouts"]]
            assert claimed == self.buffer[: len(claimed)], "oldest rollouts first"
            for ref in message["rollouts"]:
                assert self.current - ref["version"] <= self.max_staleness, "invariant 2"
                assert ref["group_ids"] == self.rollout_groups[ref["task_id"]]
                for gid in ref["group_ids"]:
                    assert self.group_state[gid] == "buffered"
                    self.group_state[gid] = "claimed"
            if step > 0:
                assert sum(len(ref["group_ids"]) for ref in message["rollouts"]) >= self.needed
            del self.buffer[: len(claimed)]
            self.batches[step] = message
            self.step_inflight = step
        self.seen_optimize = len(self.coord.dispatcher.optimize)

        for message in self.coord.dispatcher.generate[self.seen_generate :]:
            assert self.current >= 0, "no generate task before version 0"
            tid = message["task_id"]
            assert tid not in self.task_state
            self.task_state[tid] = "inflight"
            self.task_deadline[tid] = now + TIMEOUT_S * 1000
            self.task_groups[tid] = []
            for group in message["groups"]:
                gid = group["group_id"]
                assert gid not in self.group_state
                expected = self.requeue.pop(0) if self.requeue else self._next_fresh_prompt()
                assert group["prompt_index"] == expected, "requeued prompts first, then the permutation"
                self.group_state[gid] = "inflight"
                self.group_prompt[gid] = group["prompt_index"]
                self.task_groups[tid].append(gid)
        self.seen_generate = len(self.coord.dispatcher.generate)
        # Liveness: a step is claimed whenever one can be; the buffer is fed up to its bound.
        if self.step_inflight is None and self.current >= 0:
            assert self._count("buffered") < self.needed
        assert self._count("inflight") + self._count("buffered") <= self.config.async_.queue_maxsize
        if self.current >= 0 and not self.requeue:
            assert self._count("inflight") + self._count("buffered") + 2 > self.config.async_.queue_maxsize

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
        if not self.task_state:
            return
        self._submit(data.draw(st.sampled_from(sorted(self.task_state))), lag, reject_first)

    @rule(lag=st.integers(0, 2))
    def submit_every_task_in_flight(self, lag: int) -> None:
        for tid in sorted(t for t, state in self.task_state.items() if state == "inflight"):
            self._submit(tid, lag, reject_first=False)

    def _submit(self, tid: str, lag: int, reject_first: bool) -> None:
        task = {
            "task_id": tid,
            "groups": [{"group_id": g, "prompt_index": self.group_prompt[g]} for g in self.task_groups[tid]],
        }
        version = max(0, self.current - lag)
        rejected = {self.task_groups[tid][0]: "bad_prompt"} if reject_first else {}
        sub = submission(self.coord, task, version, rejected=rejected)
        state = self.task_state[tid]
        if state == "cancelled":
            with pytest.raises(TaskCancelled):
                self.coord.submit(sub)
        elif state == "stale":
            with pytest.raises(StaleRolloutError):
                self.coord.submit(sub)
        elif state == "admitted":
            assert self.coord.submit(sub).status == "duplicate"
        elif self.current - version > self.max_staleness:
            with pytest.raises(StaleRolloutError):
                self.coord.submit(sub)
            self.task_state[tid] = "stale"
            for gid in self.task_groups[tid]:
                self._end(gid, "rejected" if gid in rejected else "stale")
        else:
            assert self.coord.submit(sub).status == "admitted"
            self.task_state[tid] = "admitted"
            kept = [gid for gid in self.task_groups[tid] if gid not in rejected]
            for gid in self.task_groups[tid]:
                self.group_state[gid] = "rejected" if gid in rejected else "buffered"
            if kept:
                self.buffer.append(tid)
                self.rollout_version[tid] = version
                self.rollout_groups[tid] = kept

    @rule()
    def publish_claimed_step(self) -> None:
        if self.step_inflight is None:
            return
        version = self.step_inflight
        sha = write_fake_version(self.bucket, "r1", version)
        assert self.coord.publish(publish_request(version, sha)).current_version == version
        for ref in self.batches[version]["rollouts"]:
            for gid in ref["group_ids"]:
                assert self.group_state[gid] == "claimed", "trained at most once"
                self.group_state[gid] = "trained"
        self.current = version
        self.step_inflight = None

    @rule(kind=st.sampled_from(["zombie", "skip_ahead", "missing_manifest"]))
    def publish_wrong(self, kind: str) -> None:
        if kind == "zombie" and self.current >= 0:
            # A second trainer that also finished the step that made the current version.
            sha = self.coord.redis.hget(self.coord.keys.versions, str(self.current))
            request = publish_request(self.current, sha, worker_id="zombie")
        elif kind == "skip_ahead":
            request = publish_request(self.current + 2, "d" * 64).model_copy(update={"base_version": self.current})
        else:
            request = publish_request(self.current + 1, "e" * 64)
        with pytest.raises(PublishConflict):
            self.coord.publish(request)

    @rule()
    def lease(self) -> None:
        if self.current < 0:
            with pytest.raises(NoVersionYet):
                self.coord.lease("gen-1", "t")
            return
        grant = self.coord.lease("gen-1", "t")
        assert grant.version == self.current
        self.leases[grant.lease_id] = (grant.version, int(grant.expires_at * 1000))

    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        if not self.leases:
            return
        lease_id = data.draw(st.sampled_from(list(self.leases)))  # insertion order: lease ids are random
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
        if not self.leases:
            return
        lease_id = data.draw(st.sampled_from(list(self.leases)))  # insertion order: lease ids are random
        self.coord.release(lease_id)
        del self.leases[lease_id]

    @rule()
    def restart_proxy(self) -> None:
        """A new proxy process on the same Redis: nothing lives only in the old one's memory."""
        dispatcher = self.coord.dispatcher
        self.coord = self._new_coordinator()
        self.coord.dispatcher = dispatcher

    # ---- invariants ----

    @invariant()
    def version_matches_the_model(self) -> None:
        assert self.coord.current_version() == self.current

    @invariant()
    def leased_and_window_versions_exist(self) -> None:
        if self.current < 0:
            return
        present = set(list_versions(self.bucket, "r1"))
        now = self.clock()
        leased = {v for v, expires in self.leases.values() if expires > now}
        window = set(range(max(0, self.current - self.max_staleness - 1), self.current + 1))
        assert leased | window <= present, (leased, window, present)

    @invariant()
    def every_group_has_its_one_fate(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        gids = sorted(self.group_state)
        for gid in gids:
            pipe.hget(self.coord.keys.group(gid), "state")
        for gid, state in zip(gids, pipe.execute(), strict=True):
            assert state == self.group_state[gid], (gid, state, self.group_state[gid])
        status = self.coord.status()
        assert status.groups_inflight == self._count("inflight")
        assert status.groups_buffered == self._count("buffered")
        assert self.redis.lrange(self.coord.keys.requeue, 0, -1) == [str(p) for p in self.requeue]
        counters = status.counters
        assert counters.get("groups_trained", 0) == self._count("trained")
        assert counters.get("groups_stale", 0) == self._count("stale")
        assert counters.get("groups_cancelled", 0) == self._count("cancelled")
        assert counters.get("groups_rejected", 0) == self._count("rejected")


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
