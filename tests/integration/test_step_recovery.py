"""Dead trainers, routing and poison steps (invariants 8 and 9) against a real Redis with a manual clock."""

from __future__ import annotations

import pytest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.protocol.schemas import HeartbeatRequest, StepFailureReport, StepStartRequest, worker_queue
from proxy.coordinator.scripts import PublishConflict, StepNoLongerClaimed
from proxy.coordinator.service import Coordinator
from tests.support.proxy_harness import (
    ManualClock,
    advance_version,
    publish_next,
    publish_request,
    submit_pending,
    write_fake_version,
)


def beat(coord: Coordinator, worker_id: str, trainer_version: int | None = None) -> None:
    info = {} if trainer_version is None else {"trainer_version": trainer_version}
    coord.heartbeat(
        HeartbeatRequest(worker_id=worker_id, role="optimize", hostname="h", pid=1, state="idle", info=info)
    )


def start(coord: Coordinator, worker_id: str) -> int:
    """The worker starts the step in flight with the batch of its last message; returns the step."""
    message = coord.dispatcher.optimize[-1]
    task_ids = [ref["task_id"] for ref in message["rollouts"]]
    coord.start_step(
        message["step"], StepStartRequest(worker_id=worker_id, base_version=message["base_version"], task_ids=task_ids)
    )
    return message["step"]


def claimed_step(coord: Coordinator) -> dict:
    """Version 0 published by opt-1, then step 1 claimed and sent."""
    coord.tick()
    sha = write_fake_version(coord.bucket, coord.run, 0)
    coord.publish(publish_request(0, sha, worker_id="opt-1"))
    submit_pending(coord, set())
    coord.tick()
    submit_pending(coord, set(t["task_id"] for t in coord.dispatcher.generate[:-2]))
    coord.tick()
    assert coord.status().step_inflight == 1
    return coord.dispatcher.optimize[-1]


def claim_again(coord: Coordinator) -> set[str]:
    """After an un-claim: submit pending tasks and tick until the step is claimed again; the submitted ids."""
    unsubmitted = set(coord.redis.zrange(coord.keys.tasks_inflight, 0, -1))
    submitted = {t["task_id"] for t in coord.dispatcher.generate} - unsubmitted
    for _ in range(5):
        coord.tick()
        if coord.status().step_inflight is not None:
            break
        submit_pending(coord, submitted)
    return submitted


def groups_accounted(coord: Coordinator) -> None:
    """Invariant 4 as counters: every dispatched group is in flight, buffered, claimed or ended once."""
    status = coord.status()
    c = status.counters
    ended = c.get("groups_trained", 0) + c.get("groups_stale", 0) + c.get("groups_rejected", 0)
    ended += c.get("groups_cancelled", 0)
    inflight_step = 0
    if status.step_inflight is not None:
        inflight_step = int(coord.redis.hget(coord.keys.step(status.step_inflight), "groups") or 0)
    assert c["groups_dispatched"] == status.groups_inflight + status.groups_buffered + inflight_step + ended
    assert sum(status.rejected_by_reason.values()) == c.get("groups_rejected", 0)


def test_a_dead_holder_is_re_sent_at_once_not_after_the_timeout(coord: Coordinator, clock: ManualClock) -> None:
    beat(coord, "opt-1")
    beat(coord, "opt-2")
    first = claimed_step(coord)
    assert coord.dispatcher.optimize_queues[-1] == worker_queue(coord.run, "opt-1"), "the publisher of v0 holds it"
    assert coord.dispatcher.optimize_expires[-1] == coord.config.async_.optimize_task_timeout_s
    start(coord, "opt-1")
    clock.advance(10)
    beat(coord, "opt-2")
    assert coord.tick().step_sent is None, "the holder is within worker_alive_s"
    clock.advance(6)  # opt-1 silent for 16 s > 15 s; far below optimize_task_timeout_s
    beat(coord, "opt-2")
    assert coord.tick().step_sent == 1
    assert coord.dispatcher.optimize[-1] == first
    assert coord.dispatcher.optimize_queues[-1] is None, "the dead holder's queue is not used"
    assert coord.status().counters["optimize_resent"] == 1
    start(coord, "opt-2")
    assert coord.tick().step_sent is None, "the new holder is alive"
    assert publish_next(coord) == 1


def test_a_step_sent_to_a_worker_that_dies_before_starting_it_is_re_sent(
    coord: Coordinator, clock: ManualClock
) -> None:
    beat(coord, "opt-1")
    claimed_step(coord)
    assert coord.dispatcher.optimize_queues[-1] == worker_queue(coord.run, "opt-1")
    clock.advance(16)
    assert coord.tick().step_sent == 1
    assert coord.dispatcher.optimize_queues[-1] is None


def test_step_goes_to_a_live_worker_whose_heartbeat_holds_the_base(coord: Coordinator, clock: ManualClock) -> None:
    claimed = coord.tick()
    assert claimed.step_sent == 0 and coord.dispatcher.optimize_queues[-1] is None, "nobody holds v-1"
    publish_next(coord)  # published by trainer-1, which never heartbeats: not alive
    beat(coord, "opt-9", trainer_version=0)
    beat(coord, "opt-8", trainer_version=None)
    submitted: set[str] = set()
    for _ in range(5):
        submit_pending(coord, submitted)
        coord.tick()
    assert coord.status().step_inflight == 1
    assert coord.dispatcher.optimize_queues[-1] == worker_queue(coord.run, "opt-9")


def test_an_old_copy_of_a_step_is_refused_at_start(coord: Coordinator) -> None:
    message = claimed_step(coord)
    ids = [ref["task_id"] for ref in message["rollouts"]]
    with pytest.raises(StepNoLongerClaimed):
        coord.start_step(1, StepStartRequest(worker_id="opt-1", base_version=0, task_ids=ids[1:]))
    start(coord, "opt-1")
    publish_next(coord)
    with pytest.raises(StepNoLongerClaimed):
        coord.start_step(1, StepStartRequest(worker_id="opt-1", base_version=0, task_ids=ids))


def test_a_bad_rollout_is_rejected_and_the_step_claimed_again_without_it(coord: Coordinator) -> None:
    message = claimed_step(coord)
    start(coord, "opt-1")
    bad, *rest = message["rollouts"]
    groups_accounted(coord)
    answer = coord.report_step_failure(
        1,
        StepFailureReport(
            worker_id="opt-1",
            kind="rollout",
            reason="rollout_integrity",
            detail="sha256 mismatch",
            task_id=bad["task_id"],
        ),
    )
    assert answer.outcome == "unclaimed"
    assert answer.groups_rejected == len(bad["group_ids"])
    assert answer.groups_requeued == sum(len(r["group_ids"]) for r in rest)
    status = coord.status()
    assert status.step_inflight is None
    assert status.rejected_by_reason == {"rollout_integrity": len(bad["group_ids"])}
    assert coord.group_record(bad["group_ids"][0])["state"] == "rejected"
    assert coord.group_record(rest[0]["group_ids"][0])["state"] == "buffered"
    assert coord.redis.lrange(coord.keys.buffer, 0, len(rest) - 1) == [r["task_id"] for r in rest]
    groups_accounted(coord)
    # The next ticks claim step 1 again, without the bad rollout, and it publishes.
    submitted = claim_again(coord)
    again = coord.dispatcher.optimize[-1]
    assert again["step"] == 1 and bad["task_id"] not in {r["task_id"] for r in again["rollouts"]}
    assert again["rollouts"][: len(rest)] == rest, "the rest of the batch went back to the front"
    assert publish_next(coord) == 1
    groups_accounted(coord)
    advance_version(coord, submitted)
    groups_accounted(coord)


def test_a_failing_step_is_retried_then_its_batch_rejected(coord: Coordinator) -> None:
    beat(coord, "opt-1")
    beat(coord, "opt-2")
    message = claimed_step(coord)
    limit = coord.config.async_.max_step_attempts
    report = StepFailureReport(worker_id="opt-1", kind="step", reason="non_finite_gradient", detail="nan")
    for attempt in range(1, limit):
        start(coord, "opt-1")
        answer = coord.report_step_failure(1, report)
        assert (answer.outcome, answer.attempts) == ("retry", attempt)
        assert coord.tick().step_sent == 1, "re-sent at once"
        assert coord.dispatcher.optimize_queues[-1] == worker_queue(coord.run, "opt-2"), "not to the worker that failed"
    start(coord, "opt-1")
    answer = coord.report_step_failure(1, report)
    groups = sum(len(r["group_ids"]) for r in message["rollouts"])
    assert (answer.outcome, answer.groups_rejected, answer.groups_requeued) == ("unclaimed", groups, 0)
    assert coord.status().rejected_by_reason == {"non_finite_gradient": groups}
    groups_accounted(coord)
    # A late report of the un-claimed step changes nothing.
    assert coord.report_step_failure(1, report).outcome == "not_claimed"
    groups_accounted(coord)


def test_an_unloadable_base_goes_to_another_worker_then_halts_the_run(coord: Coordinator, clock: ManualClock) -> None:
    beat(coord, "opt-2")
    beat(coord, "opt-3")
    claimed_step(coord)  # v0's publisher opt-1 is not alive: the shared queue
    report = StepFailureReport(worker_id="opt-2", kind="base", reason="base_unloadable", detail="sha256 mismatch")
    start(coord, "opt-2")
    assert coord.report_step_failure(1, report).outcome == "retry"
    coord.tick()
    assert coord.dispatcher.optimize_queues[-1] == worker_queue(coord.run, "opt-3")
    start(coord, "opt-3")
    answer = coord.report_step_failure(1, report.model_copy(update={"worker_id": "opt-3"}))
    assert answer.outcome == "halted"
    status = coord.status()
    assert status.halted and "version 0" in status.halted and "runs/r1/adapters/v00000000" in status.halted
    assert coord.gauges().halted == status.halted
    sends = len(coord.dispatcher.optimize)
    clock.advance(coord.config.async_.optimize_task_timeout_s + 1)
    beat(coord, "opt-2")
    beat(coord, "opt-3")
    coord.tick()
    assert len(coord.dispatcher.optimize) == sends, "a halted run sends no step"
    beat(coord, "opt-4")  # a worker that has not tried joins: the halt lifts and it gets the step
    assert coord.tick().step_sent == 1
    assert coord.status().halted is None
    assert coord.dispatcher.optimize_queues[-1] == worker_queue(coord.run, "opt-4")


def test_an_upload_from_before_a_reclaim_never_publishes_and_is_cleared(coord: Coordinator) -> None:
    """A trainer thought dead uploads step 1 from its old batch after the step was un-claimed and claimed again:
    that manifest must not publish (its groups are back in the buffer or rejected), and, being create-only, it
    must not block the new batch either."""
    message = claimed_step(coord)
    start(coord, "opt-1")
    old_batch = [ref["task_id"] for ref in message["rollouts"]]
    bad = old_batch[0]
    answer = coord.report_step_failure(
        1, StepFailureReport(worker_id="opt-2", kind="rollout", reason="rollout_integrity", task_id=bad)
    )
    assert answer.outcome == "unclaimed"
    claim_again(coord)
    new_batch = [ref["task_id"] for ref in coord.dispatcher.optimize[-1]["rollouts"]]
    assert sorted(new_batch) != sorted(old_batch)
    # The zombie's upload lands now, from the old batch, and it tries to publish it.
    zombie_sha = write_fake_version(coord.bucket, coord.run, 1, worker_id="opt-1", rollouts=old_batch)
    with pytest.raises(PublishConflict, match="claimed again"):
        coord.publish(publish_request(1, zombie_sha, worker_id="opt-1"))
    assert coord.current_version() == 0
    groups_accounted(coord)
    # The new attempt finds it in the way and says so: the proxy removes it and re-sends the step at once.
    start(coord, "opt-2")
    answer = coord.report_step_failure(
        1, StepFailureReport(worker_id="opt-2", kind="upload", reason="foreign_upload", detail="another batch")
    )
    assert answer.outcome == "retry" and answer.attempts == 0
    assert coord.bucket.head(bucket_keys.manifest_key(coord.run, 1)) is None
    sends = len(coord.dispatcher.optimize)
    coord.tick()
    assert len(coord.dispatcher.optimize) == sends + 1, "re-sent at once"
    sha = write_fake_version(coord.bucket, coord.run, 1, worker_id="opt-2", rollouts=new_batch)
    assert coord.publish(publish_request(1, sha, worker_id="opt-2")).current_version == 1
    groups_accounted(coord)


def test_a_published_or_same_batch_manifest_is_never_removed(coord: Coordinator) -> None:
    message = claimed_step(coord)
    start(coord, "opt-1")
    batch = [ref["task_id"] for ref in message["rollouts"]]
    write_fake_version(coord.bucket, coord.run, 1, worker_id="opt-1", rollouts=batch)
    assert not coord.versions.remove_foreign_upload(1), "the claimed batch's own upload is republished, not removed"
    assert coord.bucket.head(bucket_keys.manifest_key(coord.run, 1)) is not None
    assert not coord.versions.remove_foreign_upload(0), "version 0 is published"
    assert coord.bucket.head(bucket_keys.manifest_key(coord.run, 0)) is not None
