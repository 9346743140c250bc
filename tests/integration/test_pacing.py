"""In-flight pacing: the limit follows the measured trainer and generate times, within queue_maxsize; the
autoscaling signal (generate workers wanted) comes from the same measurements."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest
from redis import Redis

from asyncgrpo.protocol.schemas import FleetView
from asyncgrpo.run.config import AsyncConfig
from proxy.coordinator.generate_tasks import MIN_SAMPLES, InflightPacer, workers_wanted
from proxy.coordinator.service import Coordinator
from tests.support.proxy_harness import (
    ManualClock,
    advance_version,
    file_bucket,
    make_coordinator,
    small_config,
    submission,
)


def _config(**fields: object) -> AsyncConfig:
    values: dict[str, object] = {"groups_per_task": 4, "groups_per_step": 8, "queue_maxsize": 32}
    values.update(fields)
    return AsyncConfig.model_validate(values)


def _measure(pacer: InflightPacer, clock: ManualClock, *, task_s: float, step_s: float, workers: int = 1) -> None:
    """Feed the pacer what a steady run reports: tasks taking ``task_s``, steps taking ``step_s``."""
    for step in range(1, MIN_SAMPLES + 2):
        for worker in range(workers):
            task_id = f"t{step}-{worker}"
            pacer.leased(task_id)
            clock.advance(task_s)
            pacer.submitted(task_id, f"gen-{worker}")
        pacer.step_sent(step)
        clock.advance(step_s)
        pacer.published(step)


def test_unmeasured_or_switched_off_the_limit_is_queue_maxsize() -> None:
    clock = ManualClock()
    pacer = InflightPacer(_config(), clock)
    assert pacer.limit() == 16, "a fresh proxy knows no rates: two versions' worth, not the full buffer"
    off = InflightPacer(_config(adaptive_inflight=False), clock)
    _measure(off, clock, task_s=0.05, step_s=1.0)
    assert off.limit() == 32


def test_a_trainer_bound_run_keeps_one_version_of_groups_in_flight() -> None:
    clock = ManualClock()
    pacer = InflightPacer(_config(), clock)
    _measure(pacer, clock, task_s=0.05, step_s=1.0)
    assert pacer.versions_ahead() == 1
    # Generation of a step's groups takes far less than a step: no deeper buffer than one version's groups,
    # plus room for one more task (3 groups short of a task): with 7 buffered (a rejected group leaves the
    # buffer off the task grid) and nothing in flight, a 4-group task must fit or no step is claimed again.
    assert pacer.limit() == 8 + 4 - 1


def test_a_generator_bound_run_gets_the_whole_buffer() -> None:
    clock = ManualClock()
    pacer = InflightPacer(_config(), clock)
    _measure(pacer, clock, task_s=0.5, step_s=0.1)
    assert pacer.versions_ahead() is not None and pacer.versions_ahead() > 4
    assert pacer.limit() == 32, "never above queue_maxsize"


def test_more_generate_workers_need_fewer_versions_ahead() -> None:
    one_clock, two_clock = ManualClock(), ManualClock()
    one = InflightPacer(_config(), one_clock)
    two = InflightPacer(_config(), two_clock)
    # Two tasks per version at 0.4 s each against a 0.5 s step: one worker needs two steps, two need one.
    _measure(one, one_clock, task_s=0.4, step_s=0.5, workers=1)
    _measure(two, two_clock, task_s=0.4, step_s=0.5, workers=2)
    assert one.versions_ahead() == 2 and one.limit() == 16
    assert two.versions_ahead() == 1 and two.limit() == 8 + 4 - 1


def test_workers_that_stopped_submitting_leave_the_fleet() -> None:
    clock = ManualClock()
    pacer = InflightPacer(_config(), clock)
    _measure(pacer, clock, task_s=0.4, step_s=0.5, workers=2)
    assert pacer.versions_ahead() == 1
    clock.advance(120)
    pacer.submitted("late", "gen-0")  # only one worker is still submitting
    assert pacer.versions_ahead() == 2


def test_the_coordinator_dispatches_up_to_the_paced_limit(redis_client: Redis, tmp_path: Path) -> None:
    clock = ManualClock()
    config = small_config(groups_per_task=2, groups_per_step=4, queue_maxsize=16, max_staleness=4)
    coord: Coordinator = make_coordinator(redis_client, file_bucket(tmp_path), config=config, clock=clock)
    submitted: set[str] = set()
    advance_version(coord, submitted)  # version 0
    coord.tick()
    assert coord.status().groups_inflight == 8, "unmeasured: two versions' worth of groups"
    in_flight_and_buffered = []
    # A trainer-bound run: tasks are leased and submitted quickly, each step takes a second.
    for _ in range(10):
        for task in list(coord.dispatcher.generate):
            if task["task_id"] in submitted:
                continue
            submitted.add(task["task_id"])
            coord.lease("gen-1", task["task_id"])
            clock.advance(0.01)
            coord.submit(submission(coord, task, coord.current_version()))
        assert coord.tick().step_sent is not None
        status = coord.status()
        in_flight_and_buffered.append(status.groups_inflight + status.groups_buffered)
        clock.advance(1.0)
        advance_version(coord, submitted)
    assert coord.pacer.limit() == 4 + 2 - 1  # one step of groups, and room for a task with one group short
    assert "asyncgrpo_inflight_limit_groups 5.0" in generate_latest(coord.metrics.registry).decode()
    assert in_flight_and_buffered[0] > 5, "before anything was measured the buffer was deep"
    assert in_flight_and_buffered[-1] <= 5, f"the buffer shrank to about one step of groups: {in_flight_and_buffered}"


# ---- the autoscaling signal ----


def test_workers_wanted_is_the_trainer_bound_arithmetic() -> None:
    # A version takes 8 tasks; a task takes 0.99 s (+0.01 s delivery) and a step 2 s: 4 workers keep up.
    assert workers_wanted(tasks_per_version=8, task_s=0.99, step_s=2.0, max_staleness=1, max_tasks_inflight=64) == 4
    # A slower trainer needs fewer; rounding is up (3.2 workers leave the trainer waiting).
    assert workers_wanted(tasks_per_version=8, task_s=0.99, step_s=2.5, max_staleness=1, max_tasks_inflight=64) == 4
    assert workers_wanted(tasks_per_version=8, task_s=0.99, step_s=8.0, max_staleness=1, max_tasks_inflight=64) == 1
    # Tasks slower than steps: more workers than tasks per version, several versions in flight.
    assert workers_wanted(tasks_per_version=8, task_s=2.99, step_s=1.0, max_staleness=4, max_tasks_inflight=64) == 24
    # The buffer bounds the tasks in flight: workers beyond it would only wait.
    assert workers_wanted(tasks_per_version=8, task_s=2.99, step_s=1.0, max_staleness=4, max_tasks_inflight=16) == 16
    # On-policy (max_staleness 0): a batch is sampled after the last publish; one round of tasks is the most.
    assert workers_wanted(tasks_per_version=8, task_s=0.99, step_s=0.1, max_staleness=0, max_tasks_inflight=64) == 8
    assert workers_wanted(tasks_per_version=8, task_s=0.01, step_s=60, max_staleness=1, max_tasks_inflight=64) == 1


def test_the_pacer_reports_the_fleet_it_measured() -> None:
    clock = ManualClock()
    pacer = InflightPacer(_config(), clock)  # 8 groups per version, 4 per task: 2 tasks per version
    assert pacer.fleet() is None, "nothing measured: no signal, so an autoscaler holds its fleet"
    _measure(pacer, clock, task_s=1.99, step_s=0.5, workers=2)
    fleet = pacer.fleet()
    assert fleet == FleetView(step_s=0.5, task_s=1.99, tasks_per_version=2, submitting=2, wanted=8)
    # Measured the same whether the pacing uses it or not.
    off = InflightPacer(_config(adaptive_inflight=False), clock)
    _measure(off, clock, task_s=1.99, step_s=0.5, workers=2)
    assert off.fleet() == fleet
