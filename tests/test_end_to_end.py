"""End-to-end runs with real processes: a private Redis, the proxy, `celery worker` processes (solo pool)
and a SeaweedFS bucket. Each test checks the run's own records, not log lines.

Timing knobs for tests: heartbeats every 0.3 s, a short broker visibility timeout so a killed worker's task
comes back in seconds (the tasks here take well under a second), one torch thread per process.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from proxy.coordinator.redis_keys import RunKeys
from proxy.protocol.records import StepRecord
from proxy.run.store import create_run
from proxy.storage import bucket_keys
from proxy.storage.bucket import open_bucket
from proxy.storage.manifest import latest_complete_version, read_manifest
from tests.fixtures_s3 import S3Endpoint
from worker.tools.local_cluster import ChildProcess, LocalCluster, free_port
from worker.tools.step_records import load_step_records

pytestmark = pytest.mark.slow

MAX_STALENESS = 1
SAMPLES_PER_PROMPT = 4
RATIO_TOLERANCE = 1e-3

CONFIG_TOML = """\
seed = 3

[model]
base = "tiny"

[dataset]
generator = "repeat_digit"
num_prompts = 64

[[rewards]]
name = "repeat_digit"

[sampling]
samples_per_prompt = {samples}
max_completion_length = {max_len}

[optimizer]
total_steps = 10000

[async]
max_staleness = {max_staleness}
groups_per_task = 2
groups_per_step = 4
queue_maxsize = 8
lease_ttl_s = 5
generate_task_timeout_s = {task_timeout}
optimize_task_timeout_s = 120
"""

WORKER_ENV = {
    "ASYNCGRPO_HEARTBEAT_S": "0.3",
    "ASYNCGRPO_RESTORE_INTERVAL_S": "1",
    "ASYNCGRPO_SOFT_SHUTDOWN_S": "2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@pytest.fixture
def make_cluster(
    tmp_path: Path, s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., LocalCluster]]:
    """Builds a cluster (private Redis, SeaweedFS bucket, proxy; workers are the test's to start)."""
    clusters: list[LocalCluster] = []
    for name, value in s3_endpoint.env().items():  # this process reads the bucket too
        monkeypatch.setenv(name, value)

    def build(*, visibility_timeout_s: float = 6.0, task_timeout_s: float = 120.0, max_len: int = 8) -> LocalCluster:
        run = f"e2e-{uuid.uuid4().hex[:8]}"
        env = {**s3_endpoint.env(), **WORKER_ENV, "ASYNCGRPO_VISIBILITY_TIMEOUT_S": str(visibility_timeout_s)}
        cluster = LocalCluster(
            workdir=tmp_path / run,
            run=run,
            bucket_url=s3_endpoint.bucket_url(f"{run}/"),
            extra_env=env,
        )
        clusters.append(cluster)
        config = tmp_path / f"{run}.toml"
        config.write_text(
            CONFIG_TOML.format(
                samples=SAMPLES_PER_PROMPT, max_len=max_len, max_staleness=MAX_STALENESS, task_timeout=task_timeout_s
            )
        )
        create_run(config, run, open_bucket(cluster.bucket_url))
        cluster.ensure_redis()
        cluster.start_proxy()
        return cluster

    yield build
    for cluster in clusters:
        cluster.stop()


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, cluster: LocalCluster) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cluster.check_children()
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    logs = "\n".join(f"--- {c.name}\n{c.log_tail(15)}" for c in cluster.children)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; status={cluster.status()}\n{logs}")


def records_of(cluster: LocalCluster) -> list[StepRecord]:
    return load_step_records(open_bucket(cluster.bucket_url), cluster.run)


def version_reached(cluster: LocalCluster, version: int) -> Callable[[], bool]:
    return lambda: cluster.status()["current_version"] >= version and len(records_of(cluster)) >= version


def generate_task_unsubmitted(cluster: LocalCluster) -> Callable[[str], bool]:
    redis_client = redis.Redis.from_url(cluster.redis_url)
    in_flight_key = RunKeys(cluster.run).tasks_inflight
    return lambda task_id: redis_client.zscore(in_flight_key, task_id) is not None


def step_unpublished(cluster: LocalCluster) -> Callable[[str], bool]:
    return lambda task: cluster.status()["current_version"] < int(task.split("-")[1])


def working_on(cluster: LocalCluster, worker_id: str) -> Callable[[], str | None]:
    """What the worker is doing now, read from Redis (a heartbeat lags by up to its interval, and a task
    lasts tens of milliseconds): a generate worker's task while it holds the lease it takes before sampling
    and releases with its submission; an optimize worker's step once sent and until published."""
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    keys = RunKeys(cluster.run)

    def generate_task() -> str | None:
        for lease_id in client.zrange(keys.leases, 0, -1):
            worker, task = client.hmget(keys.lease(lease_id), ["worker_id", "task_id"])
            if worker == worker_id:
                return task
        return None

    def optimize_step() -> str | None:
        step = int(client.hget(keys.state, "step_inflight") or -1)
        sent = step >= 0 and int(client.hget(keys.step(step), "sends") or 0) > 0
        return f"step-{step}" if sent else None

    return optimize_step if worker_id.startswith("opt") else generate_task


def pause_mid_task(
    cluster: LocalCluster, child: ChildProcess, worker_id: str, unfinished: Callable[[str], bool], attempts: int = 20
) -> str:
    """SIGSTOP the worker while its task's result has not reached the proxy; return the task's name.

    A pause can land just after the submit or publish: then resume and try again with its next task.
    """
    busy = working_on(cluster, worker_id)
    for _ in range(attempts):
        deadline = time.monotonic() + 60
        task = busy()
        while task is None:
            assert time.monotonic() < deadline, f"{worker_id} never got busy; status={cluster.status()}"
            cluster.check_children()
            time.sleep(0.001)
            task = busy()
        os.kill(child.pid, signal.SIGSTOP)
        if unfinished(task):
            return task
        os.kill(child.pid, signal.SIGCONT)
        wait_for(lambda done=task: busy() != done, 30, f"{worker_id} done with {task}", cluster)
    raise AssertionError(f"could not pause {worker_id} mid-task in {attempts} attempts")


def assert_run_invariants(records: list[StepRecord]) -> None:
    """Versions contiguous, nothing staler than allowed, no group trained twice, ratio near 1."""
    steps = [r.step for r in records]
    assert steps == list(range(1, len(records) + 1)), f"step records are not contiguous: {steps}"
    for record in records:
        assert record.base_version == record.step - 1
        assert record.max_staleness <= MAX_STALENESS, record.staleness
        assert all(0 <= s <= MAX_STALENESS for s in record.staleness)
        assert record.rescore_ratio is not None and abs(record.rescore_ratio - 1.0) < RATIO_TOLERANCE, record.rollouts
        assert not record.flagged_rollouts
    trained = Counter(g for r in records for rollout in r.rollouts for g in rollout.group_ids)
    twice = [g for g, n in trained.items() if n > 1]
    assert not twice, f"groups trained more than once: {twice}"
    tasks = Counter(rollout.task_id for r in records for rollout in r.rollouts)
    assert all(n == 1 for n in tasks.values()), tasks


def scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def metric_value(text: str, name: str) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
                found = True
    assert found, f"metric {name} not exported"
    return total


def test_short_run_publishes_contiguous_versions_within_staleness(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster()
    gen_port, opt_port = free_port(), free_port()
    cluster.start_worker("optimize", name="opt-1", env={"ASYNCGRPO_METRICS_PORT": str(opt_port)})
    cluster.start_worker("generate", name="gen-1", env={"ASYNCGRPO_METRICS_PORT": str(gen_port)})
    cluster.start_worker("generate", name="gen-2")
    wait_for(version_reached(cluster, 4), 240, "version 4", cluster)

    records = records_of(cluster)
    assert_run_invariants(records)
    status = cluster.status()
    assert status["counters"].get("publish", 0) >= 5  # version 0 and at least 4 steps
    # Retention (async.rollout_retention_versions = 2): rollouts of the first steps are gone from the bucket.
    bucket = open_bucket(cluster.bucket_url)
    first_steps = {ro.task_id for r in records[:2] for ro in r.rollouts}
    wait_for(
        lambda: not first_steps & {k.rsplit("/", 1)[1].removesuffix(".safetensors")
                                   for k in bucket.list(bucket_keys.rollouts_prefix(cluster.run))},
        30, "rollouts of steps 1-2 to be deleted", cluster,
    )
    assert sum(r.samples for r in records) == sum(
        r.groups for r in records
    ) * SAMPLES_PER_PROMPT

    # Invariant 7: only safetensors and JSON sit in the bucket.
    kinds = {key.rsplit(".", 1)[-1] for key in bucket.list(bucket_keys.run_prefix(cluster.run))}
    assert kinds <= {"json", "jsonl", "safetensors"}, kinds

    # Metrics move on every endpoint during a real run.
    assert metric_value(scrape(gen_port), "asyncgrpo_generate_tokens_total") > 0
    assert metric_value(scrape(opt_port), "asyncgrpo_trainer_samples_total") > 0
    proxy_metrics = httpx.get(f"{cluster.proxy_url}/metrics", timeout=5).text
    assert "asyncgrpo_" in proxy_metrics


def test_kill_generate_worker_mid_task_redelivers_it(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(max_len=32)
    cluster.start_worker("optimize", name="opt-1")
    victim = cluster.start_worker("generate", name="gen-a")
    wait_for(version_reached(cluster, 1), 180, "version 1", cluster)
    task_id = pause_mid_task(cluster, victim, "gen-a", generate_task_unsubmitted(cluster))
    cluster.expect_dead(victim)
    victim.kill_hard()  # kill -9 while its task is still unsubmitted
    killed_at = cluster.status()["current_version"]

    cluster.start_worker("generate", name="gen-b")

    def killed_task_trained() -> bool:
        return any(task_id == ro.task_id for r in records_of(cluster) for ro in r.rollouts)

    wait_for(killed_task_trained, 180, f"the killed task {task_id} to be redelivered and trained", cluster)
    wait_for(version_reached(cluster, killed_at + 2), 180, "the run to go on", cluster)
    assert_run_invariants(records_of(cluster))
    counters = cluster.status()["counters"]
    assert counters.get("tasks_cancelled", 0) == 0, "the proxy gave up on a task Celery should have redelivered"


def test_sigterm_hands_the_running_task_back_at_once(make_cluster: Callable[..., LocalCluster]) -> None:
    # A visibility timeout far longer than the test: only the hand-back can bring the task back in time.
    cluster = make_cluster(visibility_timeout_s=600, max_len=32)
    cluster.start_worker("optimize", name="opt-1")
    victim = cluster.start_worker("generate", name="gen-a", env={"ASYNCGRPO_SOFT_SHUTDOWN_S": "0"})
    wait_for(version_reached(cluster, 1), 180, "version 1", cluster)
    task_id = pause_mid_task(cluster, victim, "gen-a", generate_task_unsubmitted(cluster))
    cluster.expect_dead(victim)
    victim.popen.send_signal(signal.SIGTERM)  # to the worker process only, as systemd's KillMode=mixed does
    os.kill(victim.pid, signal.SIGCONT)
    assert victim.popen.wait(timeout=60) == 0, victim.log_tail()

    cluster.start_worker("generate", name="gen-b")

    def handed_back_task_trained() -> bool:
        return any(task_id == ro.task_id for r in records_of(cluster) for ro in r.rollouts)

    wait_for(handed_back_task_trained, 120, f"the handed-back task {task_id} to be trained", cluster)
    assert_run_invariants(records_of(cluster))
    assert cluster.status()["counters"].get("tasks_cancelled", 0) == 0


def test_kill_proxy_and_lose_redis_the_run_goes_on_from_the_bucket(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster()
    proxy = next(c for c in cluster.children if c.name == "proxy")
    cluster.start_worker("optimize", name="opt-1")
    cluster.start_worker("generate", name="gen-1")
    cluster.start_worker("generate", name="gen-2")
    wait_for(version_reached(cluster, 2), 180, "version 2", cluster)

    cluster.expect_dead(proxy)
    proxy.kill_hard()
    before = records_of(cluster)
    redis.Redis.from_url(cluster.redis_url).flushall()  # Redis comes back empty: state and queues gone
    cluster.start_proxy()  # same port; rebuilds its state from the snapshot and the manifests
    rebuilt_at = cluster.status()["current_version"]
    assert rebuilt_at >= len(before), "the rebuilt proxy went back to an older version"

    wait_for(version_reached(cluster, rebuilt_at + 3), 240, "versions after the rebuild", cluster)
    records = records_of(cluster)
    assert_run_invariants(records)
    assert records[: len(before)] == before, "published history changed"


def test_kill_optimize_worker_mid_step_continues_from_bucket(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster()
    victim = cluster.start_worker("optimize", name="opt-a")
    cluster.start_worker("generate", name="gen-1")
    cluster.start_worker("generate", name="gen-2")
    wait_for(version_reached(cluster, 2), 180, "version 2", cluster)
    task = pause_mid_task(cluster, victim, "opt-a", step_unpublished(cluster))
    cluster.expect_dead(victim)
    victim.kill_hard()  # kill -9 while its step is still unpublished
    killed_step = int(task.split("-")[1])

    cluster.start_worker("optimize", name="opt-b")
    wait_for(version_reached(cluster, killed_step + 2), 240, "steps after the killed one", cluster)
    records = records_of(cluster)
    assert_run_invariants(records)
    # opt-b had no state in memory: it loaded the killed step's base version from the bucket.
    assert any(r.worker_id == "opt-b" for r in records)
    bucket = open_bucket(cluster.bucket_url)
    latest = latest_complete_version(bucket, cluster.run)
    assert latest is not None and latest >= killed_step + 2
    manifest, _ = read_manifest(bucket, cluster.run, latest)
    assert manifest.metadata["base_version"] == latest - 1


def test_paused_generate_worker_submits_stale_rollout_and_its_prompts_are_redone(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    # A long visibility timeout: the paused worker's task must not be redelivered while it sleeps.
    cluster = make_cluster(visibility_timeout_s=300, max_len=32)
    cluster.start_worker("optimize", name="opt-1")
    sleeper = cluster.start_worker("generate", name="gen-sleepy")
    cluster.start_worker("generate", name="gen-1")
    wait_for(version_reached(cluster, 1), 180, "version 1", cluster)
    task_id = pause_mid_task(cluster, sleeper, "gen-sleepy", generate_task_unsubmitted(cluster))
    try:
        paused_at = cluster.status()["current_version"]
        wait_for(version_reached(cluster, paused_at + MAX_STALENESS + 2), 240, "versions past the window", cluster)
        stale_before = cluster.status()["counters"].get("groups_stale", 0)
    finally:
        os.kill(sleeper.pid, signal.SIGCONT)

    wait_for(lambda: cluster.status()["counters"].get("groups_stale", 0) > stale_before, 60, "a stale drop", cluster)
    # Its prompts go back in line and are dispatched again as new groups.
    wait_for(
        lambda: cluster.status()["counters"].get("groups_requeue_served", 0)
        >= cluster.status()["counters"].get("groups_stale", 0),
        60,
        "the stale groups to be dispatched again",
        cluster,
    )
    records = records_of(cluster)
    assert all(task_id != ro.task_id for r in records for ro in r.rollouts), "a stale rollout was trained"
    assert_run_invariants(records)

