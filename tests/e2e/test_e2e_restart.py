"""End-to-end, every timeout as shipped (``make_cluster(defaults=True)``): a worker killed with ``kill -9`` and
started again 5 s later under the same ``ASYNCGRPO_WORKER_ID``, as the systemd units in ``deploy/`` do
(``Restart=on-failure``, ``RestartSec=5s``).

The worker id never goes silent, so only its new incarnation can tell the proxy that the old process is gone:
its generate task is requeued within seconds and its step sent again, and the run keeps publishing (no gap of
more than 30 s). Before incarnations the task held its in-flight room until its 600 s deadline and dispatch
stopped; the step waited for the broker's 1800 s visibility timeout.

Whether the new process is heard before the old one's heartbeats would have counted as stopped
(``worker_alive_s`` after its last one) depends on how fast it starts; the kill is timed right after a
heartbeat so that it nearly always is, and each test checks which case it met: in that case nothing but the
incarnation could have ended the old work.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from cli.local_cluster import ChildProcess, LocalCluster
from proxy.coordinator.redis_store import RunKeys
from tests.support.e2e_harness import (
    assert_run_invariants,
    generate_task_unsubmitted,
    pause_mid_task,
    records_of,
    step_unpublished,
    version_reached,
    wait_for,
)

pytestmark = pytest.mark.slow

RESTART_SEC = 5.0
"""``RestartSec`` of the shipped units."""
MAX_PUBLISH_GAP_S = 30.0
VERSIONS_AFTER = 4
"""Versions the run must publish after the restart, each within ``MAX_PUBLISH_GAP_S`` of the one before."""
WORKER_ALIVE_S = 15.0
"""The proxy's shipped ``worker_alive_s``."""
PACED_FROM = 4
"""The version from which pacing follows its measurements (a tighter in-flight limit: where a ghost bit)."""


class Restart:
    """kill -9 of a worker mid-task, then the same worker id started again ``RESTART_SEC`` later."""

    def __init__(self, cluster: LocalCluster, worker_id: str) -> None:
        self.cluster = cluster
        self.worker_id = worker_id
        self.redis = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        self.keys = RunKeys(cluster.run)
        self.last_beat_ms = 0
        self.killed_at = 0.0

    def _worker(self, *fields: str) -> list[str | None]:
        return self.redis.hmget(self.keys.worker(self.worker_id), list(fields))

    def after_a_heartbeat(self) -> None:
        """Wait for a fresh heartbeat of the worker, so the kill comes early in its heartbeat interval."""
        (seen,) = self._worker("last_seen_ms")
        wait_for(lambda: self._worker("last_seen_ms")[0] != seen, 30, f"a heartbeat of {self.worker_id}", self.cluster)

    def kill_mid_task(self, child: ChildProcess, unfinished: Callable[[str], bool]) -> str:
        self.after_a_heartbeat()
        task = pause_mid_task(self.cluster, child, self.worker_id, unfinished)
        (last,) = self._worker("last_seen_ms")
        self.last_beat_ms = int(last or 0)
        self.cluster.expect_dead(child)
        child.kill_hard()
        self.killed_at = time.monotonic()
        return task

    def start_again(self, role: str) -> ChildProcess:
        time.sleep(RESTART_SEC)  # the unit's RestartSec: a delay the scenario prescribes, not a wait for state
        return self.cluster.start_worker(role, name=self.worker_id)

    def heard_again(self) -> bool:
        incarnation_ms, restarts = self._worker("incarnation_ms", "restarts")
        return int(restarts or 0) >= 1 and incarnation_ms is not None

    def only_the_incarnation_could_tell(self) -> bool:
        """The new process was heard before the old one's silence could count as death."""
        (incarnation_ms,) = self._worker("incarnation_ms")
        return int(incarnation_ms) - self.last_beat_ms < WORKER_ALIVE_S * 1000


def keeps_publishing(cluster: LocalCluster, since: float, versions: int) -> list[float]:
    """Wait for ``versions`` more versions, each within ``MAX_PUBLISH_GAP_S`` of the one before (the first of
    ``since``); returns the gaps in seconds."""
    version = cluster.status()["current_version"]
    target = version + versions
    last, gaps = since, []
    while version < target:
        cluster.check_children()
        waited = time.monotonic() - last
        assert waited <= MAX_PUBLISH_GAP_S, f"no version for {waited:.0f} s after v{version}; gaps so far {gaps}"
        time.sleep(0.2)
        now_version = cluster.status()["current_version"]
        if now_version > version:
            now = time.monotonic()
            gaps.append(round(now - last, 1))
            last, version = now, now_version
    return gaps


def test_a_generate_worker_restarted_under_its_id_has_its_task_requeued_and_the_run_goes_on(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(defaults=True)
    cluster.start_worker("optimize", name="opt-1")
    victim = cluster.start_worker("generate", name="gen-1")
    cluster.start_worker("generate", name="gen-2")
    wait_for(version_reached(cluster, PACED_FROM), 240, f"version {PACED_FROM}", cluster)
    restart = Restart(cluster, "gen-1")
    task_id = restart.kill_mid_task(victim, generate_task_unsubmitted(cluster))
    restart.start_again("generate")

    keys = RunKeys(cluster.run)
    wait_for(restart.heard_again, 120, "the restarted gen-1's first heartbeat", cluster)
    wait_for(
        lambda: restart.redis.hget(keys.task(task_id), "state") == "cancelled",
        10,
        f"the killed incarnation's task {task_id} to be requeued",
        cluster,
    )
    requeued_after = time.monotonic() - restart.killed_at
    how = restart.redis.hget(keys.task(task_id), "cancelled_as")
    if restart.only_the_incarnation_could_tell():
        assert how == "restarted", how
    assert how in ("restarted", "dead"), how
    assert requeued_after < MAX_PUBLISH_GAP_S, requeued_after
    gaps = keeps_publishing(cluster, restart.killed_at, VERSIONS_AFTER)
    print(f"task requeued {requeued_after:.1f} s after the kill ({how}); publish gaps from the kill {gaps}")
    counters = cluster.status()["counters"]
    assert counters["worker_restarts"] == 1 and counters["tasks_worker_lost"] >= 1
    assert_run_invariants(records_of(cluster))


def test_a_busy_trainer_restarted_under_its_id_takes_its_step_again_and_the_run_goes_on(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(defaults=True)
    trainer = cluster.start_worker("optimize", name="opt-1")
    cluster.start_worker("generate", name="gen-1")
    cluster.start_worker("generate", name="gen-2")
    wait_for(version_reached(cluster, PACED_FROM), 240, f"version {PACED_FROM}", cluster)
    restart = Restart(cluster, "opt-1")
    task = restart.kill_mid_task(trainer, step_unpublished(cluster))
    step = int(task.split("-")[1])
    restart.start_again("optimize")

    wait_for(restart.heard_again, 120, "the restarted opt-1's first heartbeat", cluster)
    # The only trainer, so the restarted process itself must get the step: from the shared queue, where the
    # proxy re-sent it (its old process may still hold the first copy unacknowledged).
    wait_for(version_reached(cluster, step), 60, f"step {step} published after the restart", cluster)
    published_after = time.monotonic() - restart.killed_at
    assert published_after <= MAX_PUBLISH_GAP_S + RESTART_SEC, published_after
    if restart.only_the_incarnation_could_tell():
        # Nothing else re-sends a step whose holder id keeps beating before optimize_task_timeout_s.
        assert cluster.status()["counters"].get("optimize_resent", 0) >= 1
    gaps = keeps_publishing(cluster, time.monotonic(), VERSIONS_AFTER)
    print(f"step {step} published {published_after:.1f} s after the kill; publish gaps after it {gaps}")
    record = next(r for r in records_of(cluster) if r.step == step)
    assert record.worker_id == "opt-1"
    assert cluster.status()["counters"]["worker_restarts"] == 1
    assert_run_invariants(records_of(cluster))
