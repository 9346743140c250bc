"""End-to-end, with every timeout as shipped (``make_cluster(defaults=True)``): generate-side poison ends as
counted rejections while the run reaches its final version, and a generate worker killed with kill -9 has
its prompts redone as soon as its heartbeats stop (invariants 8 and 9)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import redis

from asyncgrpo.run.datasets import repeat_digit_prompts
from cli.local_cluster import ChildProcess, LocalCluster
from proxy.api.settings import ProxySettings
from proxy.coordinator.redis_store import RunKeys
from tests.support.e2e_harness import (
    assert_run_invariants,
    generate_task_unsubmitted,
    pause_mid_task,
    records_of,
    version_reached,
    wait_for,
)
from tests.support.poison_rewards import CRASH_DIGIT_ENV

pytestmark = pytest.mark.slow

TOTAL_STEPS = 3
WORKER_ALIVE_S = ProxySettings.model_fields["worker_alive_s"].default
CRASH_DIGIT = "2"  # one prompt of the 16 that seed 3 draws


def rewards_toml(*names: str) -> str:
    return "".join(f'\n[[rewards]]\nname = "tests.support.poison_rewards:{name}"\n' for name in names)


def test_nan_and_raising_rewards_reject_their_groups_and_the_run_finishes(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    # Five prompts ("3=", "9=", "8=", "2=", "5=" for seed 3): every epoch holds both poison digits, so both are
    # dispatched long before the final version whatever the pacing.
    cluster = make_cluster(
        defaults=True, total_steps=TOTAL_STEPS, num_prompts=5, extra_toml=rewards_toml("nan_on_3", "raise_on_5")
    )
    cluster.start_worker("optimize", name="opt-1")
    cluster.start_worker("generate", name="gen-1")
    wait_for(version_reached(cluster, TOTAL_STEPS), 300, f"the final version {TOTAL_STEPS}", cluster)

    status = cluster.status()
    reasons = status["rejected_by_reason"]
    assert reasons.get("reward_not_finite", 0) >= 1, reasons
    assert any(r.startswith("reward_error_tests_support_poison_reward") for r in reasons), reasons
    assert status["counters"]["groups_rejected"] == sum(reasons.values())
    # Only the poison groups went: the tasks themselves were submitted, none failed or timed out.
    assert status["counters"].get("tasks_failed", 0) == 0
    assert status["counters"].get("tasks_cancelled", 0) == 0
    assert_run_invariants(records_of(cluster))


def test_a_prompt_that_kills_its_worker_ends_rejected_after_max_attempts(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    # Enough steps that the run outlasts three heartbeat timeouts, however fast its steps are.
    total_steps = 80
    cluster = make_cluster(
        defaults=True, total_steps=total_steps, num_prompts=16, extra_toml=rewards_toml("crash_on_digit")
    )
    cluster.start_worker("optimize", name="opt-1")
    crash_env = {CRASH_DIGIT_ENV: CRASH_DIGIT}
    workers: list[ChildProcess] = [cluster.start_worker("generate", name=f"gen-{i}", env=crash_env) for i in (1, 2)]
    started = len(workers)

    def replace_dead_workers() -> None:
        # A spot VM's replacement: every generate worker that died is replaced by a new one. (No
        # check_children: a generate worker may die at any moment here.)
        nonlocal started
        for child in list(workers):
            if not child.alive():
                cluster.expect_dead(child)
                workers.remove(child)
                started += 1
                workers.append(cluster.start_worker("generate", name=f"gen-{started}", env=crash_env))

    def wait(done: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            replace_dead_workers()
            status = cluster.status()
            if done(status):
                return status
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {status}"
            time.sleep(0.5)

    status = wait(
        lambda s: bool(s["rejected_by_reason"].get("failed_3_attempts")),
        3 * (WORKER_ALIVE_S + 60) + 120,
        "the poison prompt to be rejected",
    )
    counters = status["counters"]
    assert counters["tasks_worker_lost"] >= 3, counters
    # Only the poison prompt was rejected. Two of its groups can be in flight at once (two epochs, two
    # workers), each counting its own attempts, so both may reach the limit together.
    poison_index = _prompt_index(CRASH_DIGIT, 16)
    assert status["rejected_by_reason"] == {"failed_3_attempts": counters["groups_rejected"]}, status
    rejected_prompts = {g["prompt_index"] for g in _groups_of(cluster) if g.get("state") == "rejected"}
    assert rejected_prompts == {str(poison_index)}, rejected_prompts
    assert started >= 2 + 3, "each attempt killed a worker"
    assert not status["finished"], "the test must see the rejection before the run ends"
    # The run reaches its final version; the quarantined prompt is never dispatched again (a group of it that
    # was already in flight may still take one more worker down, and ends rejected too).
    status = wait(lambda s: s["finished"], 600, f"the final version {total_steps}")
    assert status["counters"]["prompts_quarantined"] == 1
    assert set(status["rejected_by_reason"]) == {"failed_3_attempts"}
    groups = _groups_of_prompt(cluster, poison_index)
    quarantined_ms = min(int(g["ended_ms"]) for g in groups if g.get("reason") == "failed_3_attempts")
    assert all(int(g["dispatched_ms"]) < quarantined_ms for g in groups), groups
    assert {g["state"] for g in groups} <= {"cancelled", "rejected"}, "each of its groups crashed its worker"
    assert_run_invariants(records_of(cluster))


def _prompt_index(digit: str, num_prompts: int) -> int:
    (index,) = [i for i, r in enumerate(repeat_digit_prompts(num_prompts, 3)) if r["prompt"].startswith(digit)]
    return index


def _groups_of(cluster: LocalCluster) -> list[dict[str, str]]:
    """Every group record of the run, from its Redis."""
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    keys = RunKeys(cluster.run)
    return [client.hgetall(key) for key in client.scan_iter(match=keys.group("*"), count=1000)]


def _groups_of_prompt(cluster: LocalCluster, prompt_index: int) -> list[dict[str, str]]:
    """Every group record of one prompt."""
    return [r for r in _groups_of(cluster) if r.get("prompt_index") == str(prompt_index)]


def test_kill_9_of_a_busy_generate_worker_gets_its_prompts_redone_within_seconds(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(defaults=True, max_len=32)
    cluster.start_worker("optimize", name="opt-1")
    victim = cluster.start_worker("generate", name="gen-a")
    wait_for(version_reached(cluster, 1), 180, "version 1", cluster)
    task_id = pause_mid_task(cluster, victim, "gen-a", generate_task_unsubmitted(cluster))
    cluster.expect_dead(victim)
    victim.kill_hard()
    killed_at = time.monotonic()
    cluster.start_worker("generate", name="gen-b")

    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    keys = RunKeys(cluster.run)
    # With the shipped visibility timeout (1800 s) and task timeout (600 s) only the heartbeats can do this.
    wait_for(
        lambda: client.hget(keys.task(task_id), "cancelled_as") == "dead",
        WORKER_ALIVE_S + 15,
        f"the killed worker's task {task_id} to be cancelled",
        cluster,
    )
    assert time.monotonic() - killed_at <= WORKER_ALIVE_S + 15
    prompts = {
        client.hget(keys.group(g), "prompt_index") for g in json.loads(client.hget(keys.task(task_id), "group_ids"))
    }
    # Back in line, then handed out again in new tasks (served first from the requeue line).
    wait_for(
        lambda: not prompts & set(client.lrange(keys.requeue, 0, -1)),
        10,
        "the lost prompts to be dispatched again",
        cluster,
    )
    assert client.hget(keys.counters, "groups_requeue_served") is not None
    version = cluster.status()["current_version"]
    wait_for(version_reached(cluster, version + 2), 240, "the run to go on", cluster)
    assert_run_invariants(records_of(cluster))
    assert cluster.status()["counters"]["tasks_worker_lost"] == 1
