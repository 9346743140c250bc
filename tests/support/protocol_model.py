"""The in-memory model of the protocol that ``tests/integration/test_protocol_model.py`` runs the real coordinator
against.

``ModelState`` is what the coordinator should hold: every group's fate, the tasks, the buffer, the requeue
line, the prompts' failed-attempt counts and the step in flight. ``rebuilt`` is what a rebuild from a snapshot
of that state must give (``proxy.coordinator.snapshot``). ``FlakyDispatcher`` is the recording dispatcher that
also keeps what the broker refused, so the model sees the tasks a failed send created and took back.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from asyncgrpo.bucket.backends import Bucket, ObjectExists
from asyncgrpo.protocol.schemas import GenerateTaskMessage, OptimizeTaskMessage, PublishRequest, RolloutSubmission
from tests.support.dispatcher import RecordingDispatcher
from tests.support.proxy_harness import publish_request, write_fake_version

NUM_PROMPTS = 7
SEED = 3


@dataclass
class FlakyDispatcher(RecordingDispatcher):
    """A ``RecordingDispatcher`` that also keeps the messages it refused while ``fail`` is set."""

    refused_generate: list[dict[str, Any]] = field(default_factory=list)
    refused_optimize: list[dict[str, Any]] = field(default_factory=list)

    def send_generate(self, message: GenerateTaskMessage) -> None:
        if self.fail:
            self.refused_generate.append(message.model_dump(mode="json"))
        super().send_generate(message)

    def send_optimize(
        self, message: OptimizeTaskMessage, queue: str | None = None, expires_s: float | None = None
    ) -> None:
        if self.fail:
            self.refused_optimize.append(message.model_dump(mode="json"))
        super().send_optimize(message, queue=queue, expires_s=expires_s)


@dataclass
class ModelState:
    """The protocol state the coordinator should hold (leases are kept by the machine: they are not written
    through, so whether a rebuild keeps one is not always known)."""

    current: int = -1
    group_state: dict[str, str] = field(default_factory=dict)
    group_prompt: dict[str, int] = field(default_factory=dict)
    task_groups: dict[str, list[str]] = field(default_factory=dict)
    task_state: dict[str, str] = field(default_factory=dict)  # inflight, admitted, stale, cancelled, unknown
    task_deadline: dict[str, int] = field(default_factory=dict)
    rollout_version: dict[str, int] = field(default_factory=dict)
    rollout_groups: dict[str, list[str]] = field(default_factory=dict)
    buffer: list[str] = field(default_factory=list)
    requeue: list[int] = field(default_factory=list)
    attempts: dict[int, int] = field(default_factory=dict)  # prompt -> failed attempts since it last ran
    quarantined: set[int] = field(default_factory=set)  # prompts rejected at max attempts: never dispatched again
    batches: dict[int, dict] = field(default_factory=dict)
    step_inflight: int | None = None
    step_sent_ms: int | None = None  # None: claimed but not (yet) handed to the broker
    epoch: int = 0
    pos: int = 0
    forgotten: set[str] = field(default_factory=set)  # groups whose records a rebuild dropped

    def next_fresh_prompt(self) -> int:
        """The next prompt of the seeded permutation, skipping quarantined ones."""
        while True:
            perm = list(range(NUM_PROMPTS))
            random.Random(SEED + self.epoch).shuffle(perm)
            prompt = perm[self.pos]
            self.pos += 1
            if self.pos == NUM_PROMPTS:
                self.epoch, self.pos = self.epoch + 1, 0
            if prompt not in self.quarantined:
                return prompt

    def end(self, gid: str, fate: str) -> None:
        self.group_state[gid] = fate
        if fate in ("stale", "cancelled"):
            self.requeue.append(self.group_prompt[gid])

    def ran(self, tid: str) -> None:
        """The task ran to its submission: its prompts' failed-attempt counts are cleared."""
        for gid in self.task_groups[tid]:
            self.attempts.pop(self.group_prompt[gid], None)

    def count(self, state: str) -> int:
        return sum(1 for s in self.group_state.values() if s == state)

    def task(self, tid: str) -> dict[str, Any]:
        """The generate task as its message carried it."""
        groups = [{"group_id": g, "prompt_index": self.group_prompt[g]} for g in self.task_groups[tid]]
        return {"task_id": tid, "groups": groups}

    def inflight_tasks(self) -> list[str]:
        """In-flight tasks in the coordinator's order: by deadline, then task id."""
        return [t for _, t in sorted((self.task_deadline[t], t) for t, s in self.task_state.items() if s == "inflight")]

    def expire(self, now: int, max_attempts: int) -> int:
        """Cancel the tasks past their deadline, counting an attempt per prompt (invariant 9); returns how many."""
        due = [t for t in self.inflight_tasks() if self.task_deadline[t] <= now]
        self.cancel_counted(due, max_attempts)
        return len(due)

    def cancel_counted(self, due: list[str], max_attempts: int) -> None:
        """Cancel tasks presumed lost (past their deadline, or their lease holder silent), in this order,
        counting an attempt per prompt (invariants 8 and 9)."""
        for tid in due:
            self.task_state[tid] = "cancelled"
            for gid in self.task_groups[tid]:
                prompt = self.group_prompt[gid]
                if prompt in self.quarantined:  # another group of a prompt quarantined while it was in flight
                    self.end(gid, "rejected")
                    continue
                self.attempts[prompt] = self.attempts.get(prompt, 0) + 1
                if self.attempts[prompt] >= max_attempts:
                    del self.attempts[prompt]  # the group ends rejected, not requeued, its prompt quarantined
                    self.quarantined.add(prompt)
                    self.end(gid, "rejected")
                else:
                    self.end(gid, "cancelled")

    def force_cancel(self, tid: str) -> None:
        """The broker refused the task: cancelled at once, no attempt counted (a quarantined prompt's group is
        rejected)."""
        self.task_state[tid] = "cancelled"
        for gid in self.task_groups[tid]:
            self.end(gid, "rejected" if self.group_prompt[gid] in self.quarantined else "cancelled")

    def claim(self, message: dict, max_staleness: int, needed: int) -> None:
        """The coordinator claimed a step (its optimize task, sent or refused): check it, claim its groups."""
        step = message["step"]
        assert step == self.current + 1 and message["base_version"] == self.current
        assert self.step_inflight is None, "one step in flight at a time"
        claimed = [ref["task_id"] for ref in message["rollouts"]]
        assert claimed == self.buffer[: len(claimed)], "oldest rollouts first"
        for ref in message["rollouts"]:
            assert self.current - ref["version"] <= max_staleness, "invariant 2"
            assert ref["group_ids"] == self.rollout_groups[ref["task_id"]]
            for gid in ref["group_ids"]:
                assert self.group_state[gid] == "buffered"
                self.group_state[gid] = "claimed"
        if step > 0:
            assert sum(len(ref["group_ids"]) for ref in message["rollouts"]) >= needed
        del self.buffer[: len(claimed)]
        self.batches[step] = message
        self.step_inflight, self.step_sent_ms = step, None

    def dispatched(self, message: dict, deadline_ms: int) -> None:
        """The coordinator created a generate task (sent or refused): check its prompts, put it in flight."""
        assert self.current >= 0, "no generate task before version 0"
        tid = message["task_id"]
        assert tid not in self.task_state
        self.task_state[tid] = "inflight"
        self.task_deadline[tid] = deadline_ms
        self.task_groups[tid] = []
        for group in message["groups"]:
            gid = group["group_id"]
            assert gid not in self.group_state
            while self.requeue and self.requeue[0] in self.quarantined:
                self.requeue.pop(0)  # requeued by a stale drop before its quarantine: dropped at dispatch
            expected = self.requeue.pop(0) if self.requeue else self.next_fresh_prompt()
            assert group["prompt_index"] == expected, "requeued prompts first, then the permutation"
            self.group_state[gid] = "inflight"
            self.group_prompt[gid] = group["prompt_index"]
            self.task_groups[tid].append(gid)

    def check_liveness(self, needed: int, queue_maxsize: int, paced_limit: int) -> None:
        """After a tick: a step is claimed whenever one can be; the buffer is fed up to its paced bound (the
        pacer's limit, ``queue_maxsize`` until it has measured the trainer and the generators) and never past
        ``queue_maxsize``."""
        if self.step_inflight is None and self.current >= 0:
            assert self.count("buffered") < needed
        assert self.count("inflight") + self.count("buffered") <= queue_maxsize
        if self.current >= 0 and not self.requeue and len(self.quarantined) < NUM_PROMPTS:
            assert self.count("inflight") + self.count("buffered") + 2 > min(queue_maxsize, paced_limit)

    def drop_stale(self, max_staleness: int) -> int:
        """Buffered rollouts too stale for the next step end as stale (at claim); returns groups dropped."""
        dropped = 0
        if self.step_inflight is None and self.current >= 0:
            for tid in list(self.buffer):
                if self.current - self.rollout_version[tid] > max_staleness:
                    self.buffer.remove(tid)
                    for gid in self.rollout_groups[tid]:
                        self.end(gid, "stale")
                        dropped += 1
        return dropped


def bad_submission(good: RolloutSubmission, kind: str, other_group: str, current: int) -> RolloutSubmission:
    """``good`` spoiled: a wrong rollout key, a foreign group, a group listed twice, or a future version."""
    if kind == "key":
        return good.model_copy(update={"key": good.key.replace(good.task_id, good.task_id + "-x")})
    if kind == "foreign_group":
        return good.model_copy(update={"group_ids": [*good.group_ids, other_group]})
    if kind == "twice":
        return good.model_copy(update={"group_ids": [*good.group_ids, good.group_ids[0]]})
    assert kind == "future", kind
    return good.model_copy(update={"version": current + 1})


def upload_twice(
    bucket: Bucket, version: int, same_worker: bool, second_first: bool, borrowed: bool
) -> list[PublishRequest]:
    """Two uploads of ``version``: a redelivered task (same worker, same files) finds its own manifest; another
    trainer's is refused (one manifest per version). Returns both attempts' publishes, in the order sent; the
    loser publishes the manifest that won (``borrowed``) or the one it meant to write."""
    sha = write_fake_version(bucket, "r1", version)
    if same_worker:
        assert write_fake_version(bucket, "r1", version) == sha, "a redelivered upload finds its own manifest"
        return [publish_request(version, sha)] * 2
    with pytest.raises(ObjectExists):
        write_fake_version(bucket, "r1", version, worker_id="trainer-2")
    second = publish_request(version, sha if borrowed else "f" * 64, worker_id="trainer-2")
    return [second, publish_request(version, sha)] if second_first else [publish_request(version, sha), second]


def rebuilt(snapshot: ModelState) -> ModelState:
    """What a rebuild from ``snapshot`` must restore: in-flight tasks cancelled with no attempt counted and their
    prompts requeued in the coordinator's order, the buffer and the step kept (the step to be sent again),
    the records of everything else gone (its fates stay counted)."""
    state = copy.deepcopy(snapshot)
    kept_groups: set[str] = set()
    kept_tasks = set(state.buffer)
    for tid in state.inflight_tasks():
        kept_tasks.add(tid)
        state.force_cancel(tid)
        kept_groups.update(state.task_groups[tid])
    for tid in state.buffer:
        kept_groups.update(state.rollout_groups[tid])
    if state.step_inflight is not None:
        for ref in state.batches[state.step_inflight]["rollouts"]:
            kept_tasks.add(ref["task_id"])
            kept_groups.update(ref["group_ids"])
        state.step_sent_ms = None
    for tid in state.task_state:
        if tid not in kept_tasks:
            state.task_state[tid] = "unknown"
    state.forgotten = set(state.group_state) - kept_groups
    return state
