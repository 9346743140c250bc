"""Publish -> adapter loaded on a generate worker, with and without the adapter prefetcher (issue 10).

    python3 benchmarks/bench_adapter_sync.py                         # file and SeaweedFS, both modes, 20 versions
    python3 benchmarks/bench_adapter_sync.py --backends seaweedfs --modes prefetch --versions 40

Real processes as an operator runs them (``LocalCluster``): Redis, the proxy, Celery generate workers. The run
is created with ``create_run`` on the tiny model with a LoRA rank chosen so that ``adapter_model.safetensors``
is about 4.4 MB (a rank-1 LoRA of a 1.5B model in fp32); its size is printed. This process plays the trainer:
each version is uploaded with ``write_version`` (files, then manifest) and published with the client, in strict
order, each on the step the proxy claimed.

Modes:
- ``prefetch``: the measured worker has ``ASYNCGRPO_PREFETCH_ADAPTERS=true`` and listens on a queue nobody
  sends to, so it is idle; a second generate worker ("feeder", prefetch off) makes the rollouts that let the
  proxy claim each step, and is paused (SIGSTOP) from just before each publish until the measured worker has
  loaded it, so the two do not share the CPU during the measurement.
- ``task``: prefetch off; the measured worker is the run's only generate worker and loads a version when the
  next task, dispatched right after the publish, leases it: the best case of the old path (in a busy run the
  next task may start much later). Its tasks' ``adapter_fetch_s`` (load time on the task path) is shown too.

"Loaded" is measured on the worker: the wall-clock ``timestamp`` of the backend's ``generation.adapter_loaded``
log line (JSON, written right after PEFT loaded the version) minus the wall clock just before this process
sent the publish request; one machine, one clock. Prints figures and one JSON line; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support.fixtures_s3, from a plain clone too

from asyncgrpo.bucket.layout import write_version
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.log_setup import configure_logging
from asyncgrpo.protocol.schemas import PublishRequest
from asyncgrpo.run.config import load_run_config
from asyncgrpo.run.creation import create_run
from cli.local_cluster import ChildProcess, LocalCluster
from tests.support.fixtures_s3 import open_env_bucket

# Rank 268 on every linear layer of the tiny model (2 layers, hidden 128) is 268 * 4096 fp32 parameters.
CONFIG_TOML = """\
seed = 0
[model]
base = "tiny"
[lora]
rank = {rank}
alpha = {rank}
target_modules = "all-linear"
[dataset]
generator = "repeat_digit"
num_prompts = 64
[[rewards]]
name = "repeat_digit"
[sampling]
samples_per_prompt = 2
max_completion_length = 2
[optimizer]
total_steps = 100000
[async]
max_staleness = 1
groups_per_task = 1
groups_per_step = 1
queue_maxsize = 1
generate_task_timeout_s = 120
"""
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "ASYNCGRPO_LOG_FORMAT": "json",
    "ASYNCGRPO_HEARTBEAT_S": "1",
}


class LogWatch:
    """Reads a worker's JSON log lines as they are written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.events: list[dict[str, Any]] = []

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # Celery's own banner lines
            if isinstance(event, dict):
                self.events.append(event)

    def find(self, event: str, **fields: Any) -> dict[str, Any] | None:
        self.poll()
        return next(
            (e for e in self.events if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())),
            None,
        )


def wait_for(what: str, condition: Callable[[], Any], cluster: LocalCluster, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        cluster.check_children()
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.002)


def wall(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp).timestamp()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def measure(backend: str, mode: str, versions: int, rank: int, root: Path, s3: Any) -> dict[str, Any]:
    run = f"sync-{mode}-{uuid.uuid4().hex[:6]}"
    workdir = root / run
    env = dict(WORKER_ENV)
    if s3 is not None:
        env.update(s3.env())
        os.environ.update(s3.env())  # this process writes the versions
    bucket_url = s3.bucket_url(f"{run}/") if s3 is not None else None
    cluster = LocalCluster(workdir=workdir, run=run, bucket_url=bucket_url, extra_env=env)
    os.environ["ASYNCGRPO_CACHE"] = str(workdir / "cache")  # the tiny model, built here once for all processes
    try:
        config_path = workdir / "run.toml"
        config_path.write_text(CONFIG_TOML.format(rank=rank))
        bucket = open_env_bucket(cluster.bucket_url)
        create_run(config_path, run, bucket)
        from worker.model.policy import Policy
        from worker.optimize.trainer import Trainer

        config = load_run_config(config_path)
        files = Trainer.initial(Policy.load(config.model.base), config).version_files(0)
        cluster.ensure_redis()
        cluster.start_proxy()
        prefetch = mode == "prefetch"
        measured_env = {"ASYNCGRPO_PREFETCH_ADAPTERS": str(prefetch).lower()}
        feeder: ChildProcess | None = None
        if prefetch:
            feeder = cluster.start_worker("generate", name="feeder", env={"ASYNCGRPO_PREFETCH_ADAPTERS": "false"})
            child_env = {**cluster.env(), "ASYNCGRPO_WORKER_ID": "measured", **measured_env}
            argv = [sys.executable, "-m", "cli", "worker", "generate", "--queues", "bench-idle"]
            measured = cluster._spawn("measured", argv, env=child_env)
        else:
            measured = cluster.start_worker("generate", name="measured", env=measured_env)
        logs = LogWatch(measured.log_path)
        client = ProxyClient(cluster.proxy_url, cluster.token)
        latencies: list[float] = []
        publish_calls: list[float] = []
        for version in range(versions + 1):  # version 0 is the warm-up (model load)
            # The step is claimed and the rollout for the next one is made: nothing else is going on.
            wait_for(
                f"step {version} claimed and an idle queue",
                lambda v=version: (s := cluster.status())["step_inflight"] == v and s["tasks_inflight"] == 0,
                cluster,
            )
            # The same bytes for every version (the size is what matters here), under each version's keys.
            _, sha = write_version(
                bucket, run, version, files, {"step": version, "base_version": version - 1, "worker_id": "bench"}
            )
            if feeder is not None and version > 0:
                feeder.signal_group(signal.SIGSTOP)
            sent = time.time()
            client.publish(
                PublishRequest(
                    version=version, base_version=version - 1, step=version, worker_id="bench", manifest_sha256=sha
                )
            )
            publish_calls.append(time.time() - sent)
            loaded = wait_for(
                f"version {version} loaded",
                lambda v=version: logs.find("generation.adapter_loaded", version=v),
                cluster,
                timeout_s=300 if version == 0 else 60,
            )
            if feeder is not None and version > 0:
                feeder.signal_group(signal.SIGCONT)
            if version > 0:
                latencies.append(wall(loaded["timestamp"]) - sent)
        task_loads = [
            e["timings"]["adapter_fetch_s"]
            for e in logs.events
            if e.get("event") == "generate.task_done" and e.get("timings", {}).get("adapter_fetch_s") is not None
        ]
        prefetched = [e for e in logs.events if e.get("event") == "generate.adapter_prefetched" and e["version"] > 0]

        def median_of(name: str) -> float | None:
            return round(statistics.median(e[name] for e in prefetched), 4) if prefetched else None

        tasks_on_measured = len([e for e in logs.events if e.get("event") == "generate.task_done"])
        adapter_bytes = len(files["adapter_model.safetensors"])
        return {
            "backend": backend,
            "mode": mode,
            "versions": len(latencies),
            "adapter_model_bytes": adapter_bytes,
            "version_bytes": sum(len(data) for data in files.values()),
            "publish_to_loaded_p50_s": round(statistics.median(latencies), 4),
            "publish_to_loaded_p95_s": round(percentile(latencies, 0.95), 4),
            "publish_to_loaded_max_s": round(max(latencies), 4),
            "publish_call_p50_s": round(statistics.median(publish_calls[1:]), 4),
            "prefetch_fetch_p50_s": median_of("fetch_s"),
            "prefetch_load_p50_s": median_of("load_s"),
            "tasks_on_measured_worker": tasks_on_measured,
            "task_adapter_fetch_p50_s": round(statistics.median(task_loads[1:]), 4) if len(task_loads) > 1 else None,
        }
    finally:
        cluster.stop()


@contextmanager
def seaweedfs(root: Path) -> Iterator[Any]:
    from tests.support.fixtures_s3 import start_seaweedfs

    (root / "seaweedfs").mkdir()
    process, endpoint = start_seaweedfs(root / "seaweedfs")
    try:
        yield endpoint
    finally:
        process.kill()
        process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="seaweedfs,file", help="comma list of seaweedfs, file")
    parser.add_argument("--modes", default="prefetch,task", help="comma list of prefetch, task")
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--rank", type=int, default=268, help="LoRA rank (268: a 4.4 MB adapter on the tiny model)")
    args = parser.parse_args()
    configure_logging(stream=sys.stderr, role="bench")  # stdout: the figures and the JSON line only
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-adapter-sync-") as tmp:
        root = Path(tmp)
        for backend in args.backends.split(","):
            with seaweedfs(root) if backend == "seaweedfs" else _nothing() as s3:
                for mode in args.modes.split(","):
                    figures = measure(backend, mode, args.versions, args.rank, root, s3)
                    results.append(figures)
                    print(
                        f"{backend:9s} {mode:8s} adapter_model {figures['adapter_model_bytes'] / 1e6:.2f} MB "
                        f"(version {figures['version_bytes'] / 1e6:.2f} MB)  publish->loaded "
                        f"p50 {figures['publish_to_loaded_p50_s'] * 1000:.0f} ms  "
                        f"p95 {figures['publish_to_loaded_p95_s'] * 1000:.0f} ms  "
                        f"max {figures['publish_to_loaded_max_s'] * 1000:.0f} ms  over {figures['versions']}  "
                        f"(prefetch fetch p50 {figures['prefetch_fetch_p50_s']} s, load p50 "
                        f"{figures['prefetch_load_p50_s']} s)  "
                        f"task adapter_fetch p50 {figures['task_adapter_fetch_p50_s']} s  "
                        f"tasks on measured {figures['tasks_on_measured_worker']}",
                        flush=True,
                    )
    print(json.dumps({"bench": "adapter_sync", "results": results}))


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    main()
