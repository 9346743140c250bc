"""Cost of one proxy cycle against a private local redis-server and a file:// bucket.

One cycle = what a generate task costs the proxy: lease the current version, submit the rollout, release the
lease, and a housekeeping round (``tick``: claim when a step is full, dispatch the next task, snapshot).
Publishing (when a step was claimed) is timed separately. Measured twice: calling the coordinator
directly, and through the HTTP API (real uvicorn + ProxyClient, housekeeping loop off, ticks called by the
benchmark so both paths do the same work).

    python benchmarks/bench_proxy_cycle.py [--cycles 300]

Prints ms per cycle (mean, p50, p95) for each path.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
import structlog
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import open_bucket
from asyncgrpo.bucket.layout import sha256_hex, write_version
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.schemas import LeaseRequest, PublishRequest, RolloutSubmission
from asyncgrpo.run.config import RunConfig
from proxy.api.app import create_app
from proxy.coordinator.service import Coordinator
from tests.support.dispatcher import RecordingDispatcher

TOKEN = "bench-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [
            shutil.which("redis-server") or "/usr/bin/redis-server",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(500):
        try:
            client.ping()
            return process, url
        except redis.ConnectionError:
            time.sleep(0.01)
    raise RuntimeError("redis-server did not start")


def make_coordinator(redis_url: str, root: Path, run: str) -> Coordinator:
    config = RunConfig.model_validate({"async": {"groups_per_task": 2, "groups_per_step": 4, "queue_maxsize": 16}})
    return Coordinator(
        redis.Redis.from_url(redis_url, decode_responses=True),
        open_bucket(f"file://{root / run}"),
        run,
        config,
        1000,
        RecordingDispatcher(),
        require_generate_worker=False,  # the benchmark sends no heartbeats
    )


def publish_if_claimed(coord: Coordinator, publish: Callable[[PublishRequest], object], times: list[float]) -> None:
    step = coord.status().step_inflight
    if step is None:
        return
    started = time.perf_counter()
    files = {"adapter_config.json": b'{"r": 8}'}
    _, sha = write_version(coord.bucket, coord.run, step, files, {"step": step, "base_version": step - 1})
    publish(PublishRequest(version=step, base_version=step - 1, step=step, worker_id="bench", manifest_sha256=sha))
    times.append(time.perf_counter() - started)


def run_cycles(
    coord: Coordinator,
    cycles: int,
    lease: Callable[[str, str], object],
    submit: Callable[[RolloutSubmission], object],
    release: Callable[[str], object],
    publish: Callable[[PublishRequest], object],
) -> tuple[list[float], list[float]]:
    coord.tick()
    publish_if_claimed(coord, publish, [])
    coord.tick()
    cycle_times: list[float] = []
    publish_times: list[float] = []
    done = 0
    while len(cycle_times) < cycles:
        task = coord.dispatcher.generate[done]
        done += 1
        started = time.perf_counter()
        grant = lease("bench-gen", task["task_id"])
        body = RolloutSubmission(
            task_id=task["task_id"],
            worker_id="bench-gen",
            version=grant.version,
            key=bucket_keys.rollout_key(coord.run, task["task_id"]),
            sha256=sha256_hex(task["task_id"].encode()),
            group_ids=[g["group_id"] for g in task["groups"]],
            num_samples=16,
        )
        submit(body)
        release(grant.lease_id)
        coord.tick()
        cycle_times.append(time.perf_counter() - started)
        publish_if_claimed(coord, publish, publish_times)
    return cycle_times, publish_times


def report(label: str, times: list[float]) -> None:
    ms = sorted(t * 1000 for t in times)
    p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
    mean, p50 = statistics.mean(ms), statistics.median(ms)
    print(f"{label:<34} n={len(ms):<5} mean={mean:7.2f} ms  p50={p50:7.2f} ms  p95={p95:7.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    workdir = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    process, redis_url = start_redis(workdir)
    try:
        direct = make_coordinator(redis_url, workdir, "bench-direct")
        cycles, publishes = run_cycles(direct, args.cycles, direct.lease, direct.submit, direct.release, direct.publish)
        report("direct: lease+submit+release+tick", cycles)
        report("direct: write version + publish", publishes)

        coord = make_coordinator(redis_url, workdir, "bench-http")
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(coord, TOKEN, run_loop=False),
                host="127.0.0.1",
                port=port,
                log_config=None,
                log_level="warning",
            )
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        client = ProxyClient(f"http://127.0.0.1:{port}", TOKEN)
        try:
            cycles, publishes = run_cycles(
                coord,
                args.cycles,
                lambda worker_id, task_id: client.lease(LeaseRequest(worker_id=worker_id, task_id=task_id)),
                client.submit_rollout,
                client.release,
                client.publish,
            )
        finally:
            client.close()
            server.should_exit = True
            thread.join(timeout=10)
        report("http: lease+submit+release+tick", cycles)
        report("http: write version + publish", publishes)
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
