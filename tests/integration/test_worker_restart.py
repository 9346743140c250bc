"""A worker restarted under its own id, and ghost tasks, against a real Redis with a manual clock.

A unit that restarts a crashed worker within seconds (``Restart=on-failure``) keeps its worker id, so the id's
heartbeats never stop. The proxy tells the processes apart by incarnation: a new one ends the old one's
leases at once and its generate task, eval task or step at the next round, with no clock advanced here
(invariant 8: seconds, not a timeout). Pacing leaves out tasks nobody renews a lease of, so a ghost never
stops dispatch while the buffer cannot fill a step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from redis import Redis

from asyncgrpo.protocol.schemas import HeartbeatRequest, StepStartRequest, worker_queue
from proxy.coordinator.scripts import TaskEnded
from proxy.coordinator.service import Coordinator
from tests.integration.test_evals import eval_config, make
from tests.support.proxy_harness import (
    ManualClock,
    file_bucket,
    make_coordinator,
    publish_next,
    publish_request,
    small_config,
    start_run,
    submission,
    submit_pending,
    write_fake_version,
)

RESTART_SEC = 5.0
"""The shipped units' ``RestartSec``: how long after a crash the same worker id is heard from again."""


def beat(coord: Coordinator, worker_id: str, incarnation: str | None, role: str = "generate", **info: int) -> bool:
    report = HeartbeatRequest(
        worker_id=worker_id, role=role, hostname="h", pid=1, state="busy", incarnation=incarnation, info=info
    )
    return coord.heartbeat(report)


def live_leases(coord: Coordinator, worker_id: str) -> list[str]:
    ids = coord.redis.zrangebyscore(coord.keys.leases, f"({coord.clock_ms()}", "+inf")
    return [i for i in ids if coord.redis.hget(coord.keys.lease(i), "worker_id") == worker_id]


def task_state(coord: Coordinator, task_id: str) -> tuple[str, str | None]:
    state, how = coord.redis.hmget(coord.keys.task(task_id), ["state", "cancelled_as"])
    return state, how


# ---- generate workers ----


def test_a_restarted_generate_worker_ends_its_old_task_and_lease_at_once(coord: Coordinator) -> None:
    start_run(coord)
    old_task, other = coord.dispatcher.generate[:2]
    assert beat(coord, "gen-1", "boot-100-1") is False, "the first incarnation heard is no restart"
    assert beat(coord, "gen-1", "boot-100-1") is False
    beat(coord, "gen-2", "boot-200-1")
    coord.lease("gen-1", old_task["task_id"], "boot-100-1")
    coord.lease("gen-2", other["task_id"], "boot-200-1")
    assert coord.tick().tasks_worker_lost == 0

    # kill -9, then the unit starts the same command: same id, new process, heartbeats go on.
    assert beat(coord, "gen-1", "boot-101-7") is True
    assert live_leases(coord, "gen-1") == [], "the old incarnation's lease ended with the heartbeat"
    assert len(live_leases(coord, "gen-2")) == 1
    report = coord.tick()
    assert report.tasks_worker_lost == 1
    assert task_state(coord, old_task["task_id"]) == ("cancelled", "restarted")
    assert task_state(coord, other["task_id"]) == ("inflight", None), "another worker's task is untouched"
    counters = coord.status().counters
    assert counters["worker_restarts"] == 1 and counters["tasks_worker_restarted"] == 1
    assert counters["tasks_worker_lost"] == 1 and counters["groups_cancelled"] == 2
    # Its prompts go out again at once, and the broker's late redelivery of the old task is skipped.
    lost = {g["prompt_index"] for g in old_task["groups"]}
    resent = {t["groups"][0]["prompt_index"] for t in coord.dispatcher.generate if t["task_id"] in report.tasks_sent}
    assert lost <= resent
    with pytest.raises(TaskEnded, match="cancelled"):
        coord.lease("gen-1", old_task["task_id"], "boot-101-7")
    worker = next(w for w in coord.workers() if w.worker_id == "gen-1")
    assert (worker.incarnation, worker.restarts, worker.alive) == ("boot-101-7", 1, True)


def test_the_new_incarnations_own_task_is_not_ended(coord: Coordinator) -> None:
    start_run(coord)
    first, second = coord.dispatcher.generate[:2]
    beat(coord, "gen-1", "boot-100-1")
    coord.lease("gen-1", first["task_id"], "boot-100-1")
    # The new process leases before its first heartbeat reaches the proxy: its task is its own, by incarnation.
    coord.lease("gen-1", second["task_id"], "boot-101-7")
    assert beat(coord, "gen-1", "boot-101-7") is True
    coord.tick()
    assert task_state(coord, first["task_id"])[0] == "cancelled"
    assert task_state(coord, second["task_id"]) == ("inflight", None)
    assert len(live_leases(coord, "gen-1")) == 1
    coord.submit(submission(coord, second, coord.current_version(), worker_id="gen-1"))
    assert task_state(coord, second["task_id"])[0] == "admitted"


def test_a_worker_that_sends_no_incarnation_is_judged_by_its_heartbeats_alone(
    coord: Coordinator, clock: ManualClock
) -> None:
    start_run(coord)
    task = coord.dispatcher.generate[0]
    beat(coord, "gen-1", None)
    coord.lease("gen-1", task["task_id"])
    assert beat(coord, "gen-1", None) is False
    assert coord.tick().tasks_worker_lost == 0
    clock.advance(coord.heartbeats.alive_s + 1)
    assert coord.tick().tasks_worker_lost == 1, "silence still ends it"


# ---- optimize workers ----


def claimed_step_sent_to(coord: Coordinator, publisher: str) -> dict:
    """Version 0 published by ``publisher``, then step 1 claimed and sent to its own queue."""
    coord.tick()
    coord.publish(publish_request(0, write_fake_version(coord.bucket, coord.run, 0), worker_id=publisher))
    submitted: set[str] = set()
    for _ in range(5):
        coord.tick()
        if coord.status().step_inflight is not None:
            break
        submit_pending(coord, submitted)
    assert coord.status().step_inflight == 1
    assert coord.dispatcher.optimize_queues[-1] == worker_queue(coord.run, publisher)
    return coord.dispatcher.optimize[-1]


def start(coord: Coordinator, message: dict, worker_id: str, incarnation: str) -> None:
    task_ids = [ref["task_id"] for ref in message["rollouts"]]
    request = StepStartRequest(
        worker_id=worker_id, base_version=message["base_version"], task_ids=task_ids, incarnation=incarnation
    )
    coord.start_step(message["step"], request)


def test_a_restarted_trainer_holding_the_step_has_it_re_sent_at_once(coord: Coordinator) -> None:
    beat(coord, "opt-1", "boot-1-1", role="optimize")
    message = claimed_step_sent_to(coord, "opt-1")
    start(coord, message, "opt-1", "boot-1-1")
    beat(coord, "opt-1", "boot-1-1", role="optimize")
    assert coord.tick().step_sent is None, "its holder is alive and the same process"
    beat(coord, "opt-1", "boot-1-2", role="optimize", trainer_version=-1)
    assert coord.tick().step_sent == 1
    assert coord.dispatcher.optimize[-1] == message
    # The only trainer: back on the shared queue, which the restarted worker reads too (not its own queue,
    # whose old message its dead process may still hold unacknowledged).
    assert coord.dispatcher.optimize_queues[-1] is None
    assert coord.status().counters["optimize_resent"] == 1
    start(coord, message, "opt-1", "boot-1-2")
    assert coord.tick().step_sent is None, "the new incarnation holds it now"
    assert publish_next(coord) == 1


def test_a_trainer_restarted_before_starting_its_step_has_it_re_sent(coord: Coordinator, clock: ManualClock) -> None:
    beat(coord, "opt-1", "boot-1-1", role="optimize")
    beat(coord, "opt-2", "boot-2-1", role="optimize")
    message = claimed_step_sent_to(coord, "opt-1")
    assert coord.tick().step_sent is None
    clock.advance(RESTART_SEC)
    beat(coord, "opt-2", "boot-2-1", role="optimize")
    beat(coord, "opt-1", "boot-1-2", role="optimize")
    assert coord.tick().step_sent == 1
    assert coord.dispatcher.optimize[-1] == message
    assert coord.dispatcher.optimize_queues[-1] == worker_queue(coord.run, "opt-2")


def test_a_restarted_publisher_is_no_longer_taken_to_hold_its_version(coord: Coordinator, clock: ManualClock) -> None:
    beat(coord, "opt-1", "boot-1-1", role="optimize")
    beat(coord, "opt-2", "boot-2-1", role="optimize", trainer_version=0)
    coord.tick()
    coord.publish(publish_request(0, write_fake_version(coord.bucket, coord.run, 0), worker_id="opt-1"))
    assert coord.sending.holders_of(0, coord.sending.alive_optimize_workers()) == ["opt-1", "opt-2"]
    clock.advance(RESTART_SEC)
    beat(coord, "opt-2", "boot-2-1", role="optimize", trainer_version=0)
    beat(coord, "opt-1", "boot-1-2", role="optimize")  # its memory is gone; opt-2 still reports v0
    assert coord.sending.holders_of(0, coord.sending.alive_optimize_workers()) == ["opt-2"]


# ---- eval tasks ----


def test_a_restarted_workers_eval_task_is_sent_again_at_once(
    redis_client: Redis, tmp_path: Path, clock: ManualClock
) -> None:
    coord = start_run(make(redis_client, file_bucket(tmp_path), clock, eval_config()))
    sent = len(coord.dispatcher.evals)
    beat(coord, "gen-1", "boot-100-1")
    coord.eval_lease("gen-1", "eval-r1-v0-0", "boot-100-1")
    coord.tick()
    assert len(coord.dispatcher.evals) == sent
    beat(coord, "gen-1", "boot-101-7")
    coord.tick()
    assert [m["task_id"] for m in coord.dispatcher.evals[sent:]] == ["eval-r1-v0-0"]
    assert live_leases(coord, "gen-1") == []


# ---- ghosts: tasks nobody works on never stop dispatch ----


def test_a_task_nobody_renews_is_left_out_of_the_paced_limit_not_of_queue_maxsize(
    redis_client: Redis, tmp_path: Path, clock: ManualClock
) -> None:
    """Four tasks fill the paced limit; one is admitted (too few groups for a step), two are leased and their
    leases lapse while their worker still beats (hung, or lost the task): before, dispatch stopped until the
    tasks' 600 s deadline. ``async.queue_maxsize`` still bounds every group, ghosts included."""
    config = small_config(queue_maxsize=12)
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=config, clock=clock)
    start_run(coord)
    assert coord.pacer.limit() == 8, "two versions' worth until measured, below queue_maxsize"
    first, second, third, fourth = coord.dispatcher.generate
    beat(coord, "gen-1", "boot-100-1")
    coord.submit(submission(coord, first, 0))
    coord.lease("gen-1", second["task_id"], "boot-100-1")
    coord.lease("gen-1", third["task_id"], "boot-100-1")
    assert coord.tick().tasks_sent == [] and coord.status().groups_buffered == 2
    assert coord.tasks.unattended_groups() == 0, "both leases are live"
    clock.advance(config.async_.lease_ttl_s + 1)
    beat(coord, "gen-1", "boot-100-1")
    assert coord.tasks.unattended_groups() == 4
    report = coord.tick()
    assert report.tasks_worker_lost == 0 and report.leases_expired == 2
    assert len(report.tasks_sent) == 2, "the two ghosts' room is handed out again"
    assert task_state(coord, second["task_id"])[0] == "inflight", "a late submission of a ghost is still taken"
    assert "asyncgrpo_groups_unattended 4.0" in generate_latest(coord.metrics.registry).decode()
    # A third ghost: the paced limit would leave room, queue_maxsize does not.
    coord.lease("gen-1", fourth["task_id"], "boot-100-1")
    clock.advance(config.async_.lease_ttl_s + 1)
    beat(coord, "gen-1", "boot-100-1")
    assert coord.tasks.unattended_groups() == 6
    assert coord.tick().tasks_sent == []
    status = coord.status()
    assert status.groups_inflight + status.groups_buffered == config.async_.queue_maxsize
