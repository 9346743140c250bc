"""Generate-side integrity (invariants 8 and 9) against a real Redis and a FileBucket, with a manual clock:
dead lease holders, failed-attempt counts, failure reports, refused leases, dispatch gating, bucket outages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis import Redis
from structlog.testing import capture_logs

from asyncgrpo.bucket.backends import BucketError
from asyncgrpo.protocol.schemas import (
    GenerateTaskMessage,
    GroupRef,
    HeartbeatRequest,
    StaleRolloutError,
    TaskFailureReport,
    generate_queue,
)
from proxy.coordinator.dispatch import CeleryDispatcher
from proxy.coordinator.scripts import TaskEnded
from proxy.coordinator.service import Coordinator
from tests.support.proxy_harness import (
    ManualClock,
    file_bucket,
    lease_task,
    make_coordinator,
    publish_next,
    small_config,
    start_run,
    submission,
)

ALIVE_S = Coordinator.__init__.__kwdefaults__["worker_alive_s"]  # the default an operator runs


def beat(coord: Coordinator, worker_id: str, role: str = "generate") -> None:
    coord.heartbeat(HeartbeatRequest(worker_id=worker_id, role=role, hostname="h", pid=1, state="busy"))


def attempts(coord: Coordinator) -> dict[str, str]:
    return coord.redis.hgetall(coord.keys.prompt_attempts)


def fail(coord: Coordinator, task_id: str, worker_id: str = "gen-1", reason: str = "task_error_ValueError") -> bool:
    return coord.report_task_failure(task_id, TaskFailureReport(worker_id=worker_id, reason=reason)).cancelled


def test_task_of_a_silent_lease_holder_is_cancelled_at_once(coord: Coordinator, clock: ManualClock) -> None:
    start_run(coord)
    dead_task, live_task, unleased = coord.dispatcher.generate[:3]
    beat(coord, "gen-dead")
    beat(coord, "gen-live")
    coord.lease("gen-dead", dead_task["task_id"])
    coord.lease("gen-live", live_task["task_id"])
    clock.advance(ALIVE_S - 1)
    beat(coord, "gen-live")
    assert coord.tick().tasks_worker_lost == 0, "not yet: the holder may still be alive"
    clock.advance(2)  # far below generate_task_timeout_s (600 s) and any visibility timeout
    report = coord.tick()
    assert report.tasks_worker_lost == 1 and report.tasks_cancelled == 0
    assert coord.group_record(dead_task["groups"][0]["group_id"])["state"] == "cancelled"
    assert coord.group_record(live_task["groups"][0]["group_id"])["state"] == "inflight"
    assert coord.group_record(unleased["groups"][0]["group_id"])["state"] == "inflight"
    counters = coord.status().counters
    assert counters["tasks_worker_lost"] == 1 and counters["groups_cancelled"] == 2
    # Its prompts are back in line, each alone in a task (a poison prompt must not take its partner down)...
    lost = [g["prompt_index"] for g in dead_task["groups"]]
    resent = [t for t in coord.dispatcher.generate[4:] if t["groups"][0]["prompt_index"] in lost]
    assert [len(t["groups"]) for t in resent] == [1, 1]
    assert attempts(coord) == {str(i): "1" for i in lost}
    # ... and the redelivered message of the lost task is refused a lease: the worker skips it.
    with pytest.raises(TaskEnded, match="cancelled"):
        coord.lease("gen-other", dead_task["task_id"])


def test_a_task_handed_back_before_its_worker_exits_is_not_cancelled_as_the_dead_workers(
    coord: Coordinator, clock: ManualClock
) -> None:
    """A preempted worker releases its lease and requeues the message, then exits: its silence must not cancel
    the task and count an attempt against its prompts (repeated preemptions would quarantine a good prompt)."""
    start_run(coord)
    handed_back, still_held = coord.dispatcher.generate[:2]
    beat(coord, "gen-gone")
    grant = coord.lease("gen-gone", handed_back["task_id"])
    coord.lease("gen-gone", still_held["task_id"])
    spare = coord.lease("gen-gone", still_held["task_id"])  # a second lease of one task by its holder
    assert coord.release(grant.lease_id) is True
    assert coord.release(spare.lease_id) is True  # the first lease of still_held is live: still its holder
    clock.advance(ALIVE_S + 1)
    assert coord.tick().tasks_worker_lost == 1  # still_held only
    assert coord.group_record(handed_back["groups"][0]["group_id"])["state"] == "inflight"
    assert coord.group_record(still_held["groups"][0]["group_id"])["state"] == "cancelled"
    handed_back_prompts = {str(g["prompt_index"]) for g in handed_back["groups"]}
    assert handed_back_prompts.isdisjoint(attempts(coord)), "no attempt counted against the handed-back prompts"
    # The redelivered message is leased by the next worker, which submits it.
    assert (
        coord.submit(submission(coord, handed_back, coord.current_version(), worker_id="gen-next")).status == "admitted"
    )


def test_a_prompt_failing_max_group_attempts_times_ends_rejected(coord: Coordinator, clock: ManualClock) -> None:
    start_run(coord)
    task = coord.dispatcher.generate[0]
    poison, partner = (g["prompt_index"] for g in task["groups"])
    coord.lease("gen-1", task["task_id"])
    assert fail(coord, task["task_id"])  # attempt 1 for both: a reported failure
    coord.tick()
    assert {k: v for k, v in attempts(coord).items() if ":" not in k} == {str(poison): "1", str(partner): "1"}
    # The partner, alone in its task now, succeeds: its count is cleared.
    partner_task = next(t for t in coord.dispatcher.generate[4:] if t["groups"][0]["prompt_index"] == partner)
    assert len(partner_task["groups"]) == 1
    coord.submit(submission(coord, partner_task, 0))
    assert str(partner) not in attempts(coord)
    for attempt in (2, 3):
        retry = [t for t in coord.dispatcher.generate if t["groups"][0]["prompt_index"] == poison][-1]
        assert len(retry["groups"]) == 1
        beat(coord, "gen-1")
        coord.lease("gen-1", retry["task_id"])
        clock.advance(ALIVE_S + 1)  # gen-1 dies: attempt 2 by a lost worker, attempt 3 likewise
        assert coord.tick().tasks_worker_lost == 1
        if attempt == 3:
            # The last attempts were lost workers, but the reported reason of the first is the one kept.
            record = coord.group_record(retry["groups"][0]["group_id"])
            assert record["state"] == "rejected" and record["reason"] == "task_error_valueerror"
    status = coord.status()
    assert status.counters["groups_rejected"] == 1
    assert coord.redis.hgetall(coord.keys.rejected_reasons) == {"task_error_valueerror": "1"}
    assert poison not in [int(i) for i in coord.redis.lrange(coord.keys.requeue, 0, -1)]
    # A finished prompt keeps no count; the poison one is quarantined with its reason.
    assert attempts(coord) == {f"quarantined:{poison}": "task_error_valueerror", "quarantined": "1"}
    assert status.counters["prompts_quarantined"] == 1


def _reject_after_three_failures(coord: Coordinator, prompt: int) -> None:
    for _ in range(3):
        coord.tick()
        task = [t for t in coord.dispatcher.generate if prompt in [g["prompt_index"] for g in t["groups"]]][-1]
        assert fail(coord, task["task_id"])


def test_a_quarantined_prompt_is_never_dispatched_again(coord: Coordinator) -> None:
    """Without quarantine a poison prompt fails max_group_attempts more times in every epoch (invariant 9)."""
    start_run(coord)
    poison = coord.dispatcher.generate[0]["groups"][0]["prompt_index"]
    _reject_after_three_failures(coord, poison)
    quarantined_at = len(coord.dispatcher.generate)
    for _ in range(60):  # 20 prompts, 2 per task: several epochs
        inflight = set(coord.redis.zrange(coord.keys.tasks_inflight, 0, -1))
        for task in [t for t in coord.dispatcher.generate if t["task_id"] in inflight]:
            coord.submit(submission(coord, task, coord.current_version()))
        coord.tick()
        if coord.redis.hget(coord.keys.state, "step_inflight") not in (None, "-1"):
            publish_next(coord)
    later = [g["prompt_index"] for t in coord.dispatcher.generate[quarantined_at:] for g in t["groups"]]
    assert int(coord.redis.hget(coord.keys.state, "epoch")) >= 3, "the test must cross epochs"
    assert poison not in later
    # Every other prompt still comes round: nothing else is skipped.
    assert set(later) == set(range(20)) - {poison}
    assert coord.status().counters["groups_rejected"] == 1


def test_a_failure_that_is_not_the_prompts_fault_counts_no_attempt(coord: Coordinator) -> None:
    """A worker that cannot load the adapter version (integrity error) says so; its prompts are not to blame."""
    start_run(coord)
    task = coord.dispatcher.generate[0]
    coord.lease("gen-1", task["task_id"])
    report = TaskFailureReport(worker_id="gen-1", reason="task_error_IntegrityError", prompt_at_fault=False)
    assert coord.report_task_failure(task["task_id"], report).cancelled
    assert attempts(coord) == {}
    assert coord.group_record(task["groups"][0]["group_id"])["state"] == "cancelled"
    assert coord.status().counters["tasks_failed"] == 1


def test_failure_reports_cancel_at_once_and_the_last_reason_is_kept(http, coord: Coordinator) -> None:
    from tests.support.fixtures_coordinator import API_TOKEN

    start_run(coord)
    task = coord.dispatcher.generate[0]
    coord.lease("gen-1", task["task_id"])
    assert not fail(coord, task["task_id"], worker_id="gen-2"), "only the lease holder reports its task"
    body = {"worker_id": "gen-1", "reason": "task_error_ValueError", "detail": "ValueError('boom')"}
    answer = http.post(
        f"/v1/tasks/{task['task_id']}/failure", json=body, headers={"Authorization": f"Bearer {API_TOKEN}"}
    )
    assert answer.status_code == 200 and answer.json() == {"cancelled": True}
    assert coord.status().counters["tasks_failed"] == 1
    assert not fail(coord, task["task_id"]), "a second report of a cancelled task changes nothing"
    poison = task["groups"][0]["prompt_index"]
    for _ in range(2):
        coord.tick()
        retry = [t for t in coord.dispatcher.generate if t["groups"][0]["prompt_index"] == poison][-1]
        assert fail(coord, retry["task_id"], reason="task_error_ValueError")
    assert coord.redis.hgetall(coord.keys.rejected_reasons) == {"task_error_valueerror": "1"}
    assert coord.status().counters["groups_rejected"] == 1


def test_a_stale_drop_counts_no_attempt(coord: Coordinator) -> None:
    start_run(coord)
    task = coord.dispatcher.generate[0]
    lease_task(coord, task)  # on v0
    coord.tick()
    for _ in range(2):  # two versions later the rollout made with v0 is too stale (max_staleness = 1)
        coord.redis.hset(coord.keys.state, "step_inflight", coord.current_version() + 1)
        coord.redis.hset(
            coord.keys.step(coord.current_version() + 1),
            mapping={
                "state": "claimed",
                "base_version": coord.current_version(),
                "rollouts": "[]",
                "step": coord.current_version() + 1,
            },
        )
        publish_next(coord)
    with pytest.raises(StaleRolloutError):
        coord.submit(submission(coord, task, 0))
    assert attempts(coord) == {} and coord.status().counters.get("groups_rejected", 0) == 0


def test_attempt_counts_survive_a_rebuild(redis_client: Redis, tmp_path: Path, clock: ManualClock) -> None:
    coord = start_run(make_coordinator(redis_client, file_bucket(tmp_path), clock=clock))
    task = coord.dispatcher.generate[0]
    coord.lease("gen-1", task["task_id"])
    fail(coord, task["task_id"], reason="task_error_KeyError")
    coord.snapshots.write(force=True)
    counted = attempts(coord)
    assert len(counted) == 4  # two counts, two last reasons
    redis_client.flushdb()
    fresh = make_coordinator(redis_client, file_bucket(tmp_path), clock=clock)
    assert fresh.ensure_state() == "rebuilt"
    assert attempts(fresh) == counted


def test_no_generate_task_while_no_generate_worker_is_alive(redis_client: Redis, tmp_path: Path) -> None:
    clock = ManualClock()
    coord = make_coordinator(redis_client, file_bucket(tmp_path), clock=clock, require_generate_worker=True)
    coord.tick()
    publish_next(coord)
    beat(coord, "opt-1", role="optimize")
    assert coord.tick().tasks_sent == [] and coord.status().tasks_inflight == 0
    beat(coord, "gen-1")
    assert len(coord.tick().tasks_sent) == 4
    clock.advance(ALIVE_S + 1)  # gen-1 went silent: the queue does not grow any further
    coord.submit(submission(coord, coord.dispatcher.generate[0], 0))
    assert coord.tick().tasks_sent == []


def test_a_bucket_outage_undoes_new_tasks_without_counting_and_pauses_dispatch(coord: Coordinator) -> None:
    coord.tick()
    publish_next(coord)
    real_put = coord.snapshots.bucket.put_if_match
    down = {"on": True}

    def put(key: str, data: bytes, etag: str | None) -> str:
        if down["on"]:
            raise BucketError("injected: the bucket is unreachable")
        return real_put(key, data, etag)

    coord.snapshots.bucket.put_if_match = put  # type: ignore[method-assign]
    before = coord.status().counters
    with capture_logs() as logs:
        for _ in range(5):
            report = coord.tick()
            assert report.tasks_sent == []
    assert report.tasks_undone == 0, "no new task is even created while the bucket is down"
    status = coord.status()
    assert status.tasks_inflight == 0 and coord.dispatcher.generate == []
    for counter in ("tasks_cancelled", "groups_cancelled", "tasks_dispatched", "groups_dispatched"):
        assert status.counters.get(counter, 0) == before.get(counter, 0), counter
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["proxy.snapshot_failed"]
    undone = [int(i) for i in coord.redis.lrange(coord.keys.requeue, 0, -1)]
    assert len(undone) == 8, "the first round's tasks were taken back, their prompts first in line"
    down["on"] = False
    with capture_logs() as logs:
        report = coord.tick()
    assert [e["event"] for e in logs if e["event"].startswith("proxy.snapshot")] == ["proxy.snapshot_recovered"]
    coord.tick()  # the round after a successful snapshot dispatches again
    assert [g["prompt_index"] for t in coord.dispatcher.generate for g in t["groups"]] == undone
    assert coord.status().counters["tasks_dispatched"] == 4


def test_leases_are_refused_for_ended_and_forgotten_tasks(coord: Coordinator) -> None:
    start_run(coord)
    task = coord.dispatcher.generate[0]
    coord.submit(submission(coord, task, 0))
    with pytest.raises(TaskEnded, match="admitted"):
        coord.lease("gen-1", task["task_id"])
    with pytest.raises(TaskEnded, match="unknown"):
        coord.lease("gen-1", "gen-r1-0-99999999")  # this run's form, never dispatched (or forgotten)


def test_generate_messages_expire_at_their_deadline(redis_url: str) -> None:
    message = GenerateTaskMessage(
        run="r1", task_id="gen-r1-0-00000001", groups=[GroupRef(group_id="g.0", prompt_index=0)], expires_at=2e9
    )
    CeleryDispatcher(redis_url).send_generate(message)
    raw = Redis.from_url(redis_url, decode_responses=True).lrange(generate_queue("r1"), 0, -1)
    headers = json.loads(raw[0])["headers"]
    assert headers["expires"].startswith("2033-05-18T03:33:20"), headers["expires"]
    # What `celery inspect` shows of it: the kwargs as JSON (written by the JSON encoder, not Celery's repr).
    assert (headers["argsrepr"], json.loads(headers["kwargsrepr"])) == ("()", message.model_dump(mode="json"))


def test_max_group_attempts_config(redis_client: Redis, tmp_path: Path, clock: ManualClock) -> None:
    coord = make_coordinator(
        redis_client, file_bucket(tmp_path), clock=clock, config=small_config(max_group_attempts=1)
    )
    start_run(coord)
    clock.advance(coord.config.async_.generate_task_timeout_s + 1)
    coord.tick()
    assert coord.redis.hgetall(coord.keys.rejected_reasons) == {"failed_1_attempts": "8"}


def test_a_run_whose_every_prompt_is_quarantined_halts_saying_so(
    redis_client: Redis, tmp_path: Path, clock: ManualClock
) -> None:
    config = small_config(max_group_attempts=1, groups_per_task=2, queue_maxsize=8)
    coord = make_coordinator(redis_client, file_bucket(tmp_path), clock=clock, config=config, num_prompts=4)
    start_run(coord)
    clock.advance(coord.config.async_.generate_task_timeout_s + 1)
    coord.tick()  # every prompt in flight failed its one attempt: all four quarantined
    assert coord.status().counters["prompts_quarantined"] == 4
    sent = len(coord.dispatcher.generate)
    coord.tick()
    assert len(coord.dispatcher.generate) == sent, "nothing left to dispatch"
    assert "all 4 prompts" in (coord.status().halted or "")
