"""The end-to-end harness (a pytest plugin): clusters of real processes and the checks of their records.

A cluster is a private Redis, the proxy, `celery worker` processes (solo pool) and a SeaweedFS bucket; tests
check the run's own records, not log lines.

``make_cluster()`` has two modes. The default one shortens the timing knobs so a test runs in seconds:
heartbeats every 0.3 s, a short broker visibility timeout so a killed worker's task comes back at once (the
tasks here take well under a second). ``make_cluster(defaults=True)`` keeps every timeout an operator runs
with (heartbeats, liveness, visibility, task and lease timeouts): the sibling tests that show recovery with
default settings use it. Both give one torch thread per process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from asyncgrpo.protocol.records import StepRecord
from asyncgrpo.run.creation import create_run
from cli.history import load_step_records
from cli.local_cluster import ChildProcess, LocalCluster
from proxy.coordinator.redis_store import RunKeys
from tests.support.fixtures_s3 import S3Endpoint, open_env_bucket

MAX_STALENESS = 1
SAMPLES_PER_PROMPT = 4
RATIO_TOLERANCE = 1e-3
PAUSE_SETTLE_S = 0.5  # seconds a paused worker's last request is given to land (pause_mid_task)

CONFIG_HEAD = """\
seed = 3

[model]
base = "tiny"

[dataset]
generator = "repeat_digit"
num_prompts = {num_prompts}

[[rewards]]
name = "repeat_digit"

[sampling]
samples_per_prompt = {samples}
max_completion_length = {max_len}

[optimizer]
total_steps = {total_steps}

[async]
max_staleness = {max_staleness}
groups_per_task = 2
groups_per_step = 4
queue_maxsize = 8
"""
SHORT_TIMEOUTS_TOML = """\
lease_ttl_s = 5
generate_task_timeout_s = {task_timeout}
optimize_task_timeout_s = 120
"""
THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

WORKER_ENV = {
    "ASYNCGRPO_HEARTBEAT_S": "0.3",
    "ASYNCGRPO_RESTORE_INTERVAL_S": "1",
    "ASYNCGRPO_SOFT_SHUTDOWN_S": "2",
    **THREADS_ENV,
}


@pytest.fixture
def make_cluster(
    tmp_path: Path, s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., LocalCluster]]:
    """Builds a cluster (private Redis, SeaweedFS bucket, proxy; workers are the test's to start)."""
    clusters: list[LocalCluster] = []
    for name, value in s3_endpoint.env().items():  # this process reads the bucket too
        monkeypatch.setenv(name, value)

    def build(
        *,
        visibility_timeout_s: float = 6.0,
        task_timeout_s: float = 120.0,
        max_len: int = 8,
        defaults: bool = False,
        extra_toml: str = "",
        total_steps: int = 10000,
        num_prompts: int = 64,
        head: str = CONFIG_HEAD,
        samples_per_prompt: int = SAMPLES_PER_PROMPT,
    ) -> LocalCluster:
        """``defaults``: every timeout as shipped (the other knobs then must not be given). ``extra_toml`` is
        appended after the ``[async]`` keys (async keys, or further tables such as another ``[[rewards]]``).
        ``head``: another config head with CONFIG_HEAD's placeholders, ending in its ``[async]`` table."""
        run = f"e2e-{uuid.uuid4().hex[:8]}"
        if defaults:
            env = {**s3_endpoint.env(), **THREADS_ENV}
        else:
            env = {**s3_endpoint.env(), **WORKER_ENV, "ASYNCGRPO_VISIBILITY_TIMEOUT_S": str(visibility_timeout_s)}
        cluster = LocalCluster(
            workdir=tmp_path / run,
            run=run,
            bucket_url=s3_endpoint.bucket_url(f"{run}/"),
            extra_env=env,
        )
        clusters.append(cluster)
        config = tmp_path / f"{run}.toml"
        toml = head.format(
            samples=samples_per_prompt,
            max_len=max_len,
            max_staleness=MAX_STALENESS,
            total_steps=total_steps,
            num_prompts=num_prompts,
        )
        if not defaults:
            toml += SHORT_TIMEOUTS_TOML.format(task_timeout=task_timeout_s)
        # extra_toml goes after the [async] keys: start it with a table header for another table.
        config.write_text(toml + extra_toml)
        create_run(config, run, open_env_bucket(cluster.bucket_url))
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
    return load_step_records(open_env_bucket(cluster.bucket_url), cluster.run)


def version_reached(cluster: LocalCluster, version: int) -> Callable[[], bool]:
    return lambda: cluster.status()["current_version"] >= version and len(records_of(cluster)) >= version


def stale_groups_redispatched(cluster: LocalCluster) -> Callable[[], bool]:
    """Every group dropped as stale had its prompt dispatched again (from the requeue line)."""

    def redispatched() -> bool:
        counters = cluster.status()["counters"]
        return counters.get("groups_requeue_served", 0) >= counters.get("groups_stale", 0)

    return redispatched


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
        # A request the worker sent just before the stop still lands (a publish, a submission): let it, so
        # that "unfinished" is judged on what the proxy will hold, not on a reply still in flight.
        time.sleep(PAUSE_SETTLE_S)
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


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM a worker started in its own process group (its Celery children too); SIGKILL after 30 s."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


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
