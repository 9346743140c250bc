"""How long a fault costs with the settings an operator runs (every timeout as shipped): seconds, not minutes.

    python3 benchmarks/bench_recovery.py                          # every scenario, file:// bucket
    python3 benchmarks/bench_recovery.py --scenarios kill_trainer --repeats 3
    python3 benchmarks/bench_recovery.py --bucket seaweedfs

Each scenario starts the real system (a private redis-server, ``asyncgrpo proxy``, Celery workers started as
an operator starts them) on the tiny model with no timeout shortened, injects one fault and measures:

- ``kill_trainer``: kill -9 of the optimize worker holding the step in flight, a stand-by trainer running.
  Seconds from the kill to the next published version (the step re-sent once the holder's heartbeats stop).
- ``kill_generator``: kill -9 of a generate worker holding a lease. Seconds from the kill to its task being
  cancelled and its prompts requeued (``tasks_worker_lost``).
- ``restart_generator``: kill -9 of a generate worker holding a lease, then the same worker id started again
  5 s later (the systemd units' ``RestartSec``). Seconds from the kill to its task being cancelled.
- ``restart_trainer``: kill -9 of the only optimize worker holding the step in flight, then the same worker id
  started again 5 s later. Seconds from the kill to the step's version published.
- ``corrupt_adapter``: the current version's adapter weights overwritten in the bucket while the trainer that
  published them is alive; a fresh generate worker (empty cache) then has to load that version. Seconds from
  its start to the next published version (the trainer puts the bytes back from memory).

One JSON line per measurement, then a summary line (median per scenario). Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.layout import read_manifest
from asyncgrpo.run.creation import create_run
from cli.local_cluster import ChildProcess, LocalCluster
from proxy.coordinator.redis_store import RunKeys
from tests.support.e2e_harness import wait_for
from tests.support.fixtures_s3 import open_env_bucket

CONFIG = """\
seed = 3

[model]
base = "tiny"

[dataset]
generator = "repeat_digit"
num_prompts = 64

[[rewards]]
name = "repeat_digit"

[sampling]
samples_per_prompt = 4
max_completion_length = 8

[optimizer]
total_steps = 10000

[async]
max_staleness = 1
groups_per_task = 2
groups_per_step = 4
queue_maxsize = 8
"""
THREADS = {"ASYNCGRPO_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _wait(cluster: LocalCluster, predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    return wait_for(predicate, timeout_s, what, cluster)  # polls every 0.2 s: the figures' resolution


def _version(cluster: LocalCluster) -> int:
    return int(cluster.status()["current_version"])


def kill_trainer(cluster: LocalCluster, keys: RunKeys, client: redis.Redis) -> float:
    busy = cluster.start_worker("optimize", name="opt-1", env=THREADS)
    for index in (1, 2):
        cluster.start_worker("generate", name=f"gen-{index}", env=THREADS)
    _wait(cluster, lambda: _version(cluster) >= 3, 300, "version 3")
    cluster.start_worker("optimize", name="opt-2", env=THREADS)  # the stand-by
    time.sleep(6)  # its first heartbeat

    def opt1_holds_a_step() -> int | None:
        step = int(client.hget(keys.state, "step_inflight") or -1)
        return step if step >= 0 and client.hget(keys.step(step), "holder") == "opt-1" else None

    step = _wait(cluster, opt1_holds_a_step, 120, "opt-1 holding a step")
    cluster.expect_dead(busy)
    busy.kill_hard()
    killed = time.monotonic()
    _wait(cluster, lambda: _version(cluster) >= step, 600, f"step {step} published")
    return time.monotonic() - killed


def kill_generator(cluster: LocalCluster, keys: RunKeys, client: redis.Redis) -> float:
    cluster.start_worker("optimize", name="opt-1", env=THREADS)
    victim = cluster.start_worker("generate", name="gen-a", env=THREADS)
    cluster.start_worker("generate", name="gen-b", env=THREADS)
    _wait(cluster, lambda: _version(cluster) >= 2, 300, "version 2")

    def gen_a_holds_a_lease() -> bool:
        leases = client.zrange(keys.leases, 0, -1)
        return any(client.hget(keys.lease(lease), "worker_id") == "gen-a" for lease in leases)

    _wait(cluster, gen_a_holds_a_lease, 120, "gen-a holding a lease")
    os.kill(victim.pid, signal.SIGSTOP)  # frozen mid-task, so the kill lands while the task is unsubmitted
    lost_before = int(cluster.status()["counters"].get("tasks_worker_lost", 0))
    cluster.expect_dead(victim)
    victim.kill_hard()
    killed = time.monotonic()
    _wait(
        cluster,
        lambda: int(cluster.status()["counters"].get("tasks_worker_lost", 0)) > lost_before,
        600,
        "the lost task cancelled",
    )
    return time.monotonic() - killed


RESTART_SEC = 5.0
"""``RestartSec`` of the shipped systemd units."""


def _kill_and_restart(cluster: LocalCluster, child: ChildProcess, role: str) -> float:
    """kill -9 of ``child`` frozen mid-task, then its worker id started again ``RESTART_SEC`` later; the
    kill's time (monotonic)."""
    os.kill(child.pid, signal.SIGSTOP)
    cluster.expect_dead(child)
    child.kill_hard()
    killed = time.monotonic()
    time.sleep(RESTART_SEC)
    cluster.start_worker(role, name=child.name, env=THREADS)
    return killed


def restart_generator(cluster: LocalCluster, keys: RunKeys, client: redis.Redis) -> float:
    victim = cluster.start_worker("generate", name="gen-a", env=THREADS)
    cluster.start_worker("generate", name="gen-b", env=THREADS)
    cluster.start_worker("optimize", name="opt-1", env=THREADS)
    _wait(cluster, lambda: _version(cluster) >= 4, 300, "version 4")

    def gen_a_task() -> str | None:
        for lease in client.zrange(keys.leases, 0, -1):
            worker, task = client.hmget(keys.lease(lease), ["worker_id", "task_id"])
            if worker == "gen-a":
                return task
        return None

    task = _wait(cluster, gen_a_task, 120, "gen-a holding a lease")
    killed = _kill_and_restart(cluster, victim, "generate")
    _wait(cluster, lambda: client.hget(keys.task(task), "state") == "cancelled", 600, f"task {task} cancelled")
    return time.monotonic() - killed


def restart_trainer(cluster: LocalCluster, keys: RunKeys, client: redis.Redis) -> float:
    busy = cluster.start_worker("optimize", name="opt-1", env=THREADS)
    for index in (1, 2):
        cluster.start_worker("generate", name=f"gen-{index}", env=THREADS)
    _wait(cluster, lambda: _version(cluster) >= 4, 300, "version 4")

    def opt1_holds_a_step() -> int | None:
        step = int(client.hget(keys.state, "step_inflight") or -1)
        return step if step >= 0 and client.hget(keys.step(step), "holder") == "opt-1" else None

    step = _wait(cluster, opt1_holds_a_step, 120, "opt-1 holding a step")
    killed = _kill_and_restart(cluster, busy, "optimize")
    _wait(cluster, lambda: _version(cluster) >= step, 600, f"step {step} published")
    return time.monotonic() - killed


def corrupt_adapter(cluster: LocalCluster, keys: RunKeys, client: redis.Redis) -> float:
    cluster.start_worker("optimize", name="opt-1", env=THREADS)
    first = cluster.start_worker("generate", name="gen-1", env=THREADS)
    _wait(cluster, lambda: _version(cluster) >= 2, 300, "version 2")
    cluster.expect_dead(first)
    first.kill_hard()  # the only generator stops: no version moves until a new one loads the current one
    time.sleep(1)
    bucket = open_env_bucket(cluster.bucket_url)
    version = _version(cluster)
    manifest, _ = read_manifest(bucket, cluster.run, version)
    bucket.put(manifest.file_key(cluster.run, bucket_keys.ADAPTER_WEIGHTS_NAME), b"not the published weights")
    started = time.monotonic()
    cluster.start_worker("generate", name="gen-2", env=THREADS)
    _wait(cluster, lambda: _version(cluster) > version, 600, f"a version after {version}")
    return time.monotonic() - started


SCENARIOS: dict[str, Callable[[LocalCluster, RunKeys, redis.Redis], float]] = {
    "kill_trainer": kill_trainer,
    "kill_generator": kill_generator,
    "restart_generator": restart_generator,
    "restart_trainer": restart_trainer,
    "corrupt_adapter": corrupt_adapter,
}


def measure(name: str, workdir: Path, bucket_url: str | None, bucket_env: dict[str, str]) -> float:
    run = f"rec-{uuid.uuid4().hex[:8]}"
    cluster = LocalCluster(workdir=workdir / run, run=run, bucket_url=bucket_url, extra_env=bucket_env)
    try:
        cluster.ensure_redis()
        config = workdir / f"{run}.toml"
        config.write_text(CONFIG)
        create_run(config, run, open_env_bucket(cluster.bucket_url))
        cluster.start_proxy()
        client = redis.Redis.from_url(cluster.redis_url or "", decode_responses=True)
        return SCENARIOS[name](cluster, RunKeys(run), client)
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--bucket", choices=("file", "seaweedfs"), default="file")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    server = None
    bucket_env: dict[str, str] = {}
    bucket_url: Callable[[str], str | None] = lambda name: None  # noqa: E731
    if args.bucket == "seaweedfs":
        from tests.support.fixtures_s3 import start_seaweedfs

        (workdir / "seaweedfs").mkdir()
        server, endpoint = start_seaweedfs(workdir / "seaweedfs")
        bucket_env = endpoint.env()
        os.environ.update(bucket_env)  # this process reads the bucket too
        bucket_url = lambda name: endpoint.bucket_url(f"{name}/")  # noqa: E731
    results: dict[str, list[float]] = {}
    try:
        for name in args.scenarios.split(","):
            for repeat in range(args.repeats):
                seconds = measure(name, workdir, bucket_url(name), bucket_env)
                results.setdefault(name, []).append(seconds)
                print(json.dumps({"scenario": name, "repeat": repeat, "seconds": round(seconds, 2)}), flush=True)
    finally:
        if server is not None:
            server.kill()
    summary = {name: round(statistics.median(values), 2) for name, values in results.items()}
    print(json.dumps({"median_seconds": summary, "bucket": args.bucket, "settings": "defaults"}), flush=True)


if __name__ == "__main__":
    main()
