"""The simulated workers of ``bench_proxy_scale.py``: generate workers over HTTP, and an optimizer.

Each generate worker loops: take a real ``generate`` task message the proxy dispatched from its run's Celery
broker list in Redis, lease, submit a rollout for exactly that task's groups, naming the lease so that the
submission releases it (as a real generate worker does; ``--separate-release`` sends a DELETE instead, the
older protocol); every ``CHECK_EVERY``-th
admitted rollout is looked up in the bucket's snapshot right after the answer. The optimizer takes each
``optimize`` task, writes a small real version and publishes it. Latencies are kept per request kind.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from typing import Any

import httpx
import redis
import redis.asyncio as aioredis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.bucket.layout import write_version
from asyncgrpo.protocol.schemas import generate_queue, optimize_queue
from proxy.coordinator.snapshot import load_snapshot
from tests.support.fixtures_s3 import open_env_bucket

TOKEN = "bench-scale-token"
RUN = "scale"
GENERATE_QUEUE = generate_queue(RUN)  # the broker lists the proxy of RUN sends to
OPTIMIZE_QUEUE = optimize_queue(RUN)
HEARTBEAT_S = 5.0

CHECK_EVERY = 25
"""Every this many admitted submits, a worker reads the snapshot and its log from the bucket to check the rollout is
in it."""
KINDS = ("lease", "submit", "release", "heartbeat", "publish", "metrics")


def decode_task(raw: str) -> dict[str, Any]:
    """The kwargs of a Celery task message as kombu's Redis transport stores it (JSON, base64 body)."""
    envelope = json.loads(raw)
    body = envelope["body"]
    if envelope.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    _args, kwargs, _embed = json.loads(body)
    return kwargs


# ---- simulated generate workers (run in --procs child processes) ----


async def _generate_workers(
    proxy_url: str,
    redis_url: str,
    bucket_url: str,
    first: int,
    count: int,
    start_at: float,
    stop_at: float,
    separate_release: bool,
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    client = httpx.AsyncClient(base_url=proxy_url, headers=headers, limits=limits, timeout=30.0)
    broker = aioredis.Redis.from_url(redis_url, decode_responses=True)
    tasks: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    latencies: dict[str, list[float]] = {kind: [] for kind in KINDS}
    outcome = {"cycles": 0, "refused": 0, "errors": 0, "durable_checked": 0, "durable_missing": 0}
    bucket = open_env_bucket(bucket_url)
    admitted = 0

    async def check_durable(task_id: str, leased_version: int) -> None:
        # Read after the answer: the snapshot with its log, as a rebuild reads it, must name the task (buffered,
        # or in the step that claimed it since). Only decidable while no version was published after the lease: a
        # later publish may have trained it, and trained rollouts are not in the snapshot (retention off).
        document = await asyncio.to_thread(load_snapshot, bucket, RUN)
        assert document is not None
        if int(document["state"].get("current_version", -1)) != leased_version:
            return
        outcome["durable_checked"] += 1
        if f'"{task_id}"' not in json.dumps(document):
            outcome["durable_missing"] += 1

    async def feeder() -> None:
        # One consumer per process takes messages off the broker list for its workers (as Celery would); it
        # blocks on the broker rather than polling, so the load generator leaves the CPU to the proxy.
        while time.time() < stop_at:
            if tasks.qsize() >= count:
                await asyncio.sleep(0.01)
                continue
            popped = await broker.brpop([GENERATE_QUEUE], timeout=1)
            if popped is None:
                continue
            raws = [popped[1], *(await broker.rpop(GENERATE_QUEUE, count - 1) or [])]
            for raw in raws:
                tasks.put_nowait(decode_task(raw))
        for _ in range(count):
            tasks.put_nowait(None)  # each worker stops at its first None

    async def timed(kind: str, method: str, path: str, body: Any = None) -> httpx.Response:
        started = time.perf_counter()
        response = await client.request(method, path, json=body)
        if time.time() >= start_at:
            latencies[kind].append(time.perf_counter() - started)
        return response

    async def worker(index: int) -> None:
        worker_id = f"sim-gen-{index:04d}"
        next_heartbeat = 0.0
        while time.time() < stop_at:
            if time.time() >= next_heartbeat:
                next_heartbeat = time.time() + HEARTBEAT_S
                report = {
                    "worker_id": worker_id,
                    "role": "generate",
                    "hostname": "bench",
                    "pid": os.getpid(),
                    "state": "generating",
                }
                try:
                    await timed("heartbeat", "POST", "/v1/workers/heartbeat", report)
                except httpx.HTTPError:
                    outcome["errors"] += 1
            task = await tasks.get()
            if task is None:
                return
            try:
                lease = await timed("lease", "POST", "/v1/leases", {"worker_id": worker_id, "task_id": task["task_id"]})
                if lease.status_code != 200:
                    outcome["errors"] += 1
                    continue
                grant = lease.json()
                group_ids = [group["group_id"] for group in task["groups"]]
                submission = {
                    "task_id": task["task_id"],
                    "worker_id": worker_id,
                    "version": grant["version"],
                    "key": bucket_keys.rollout_key(RUN, task["task_id"]),
                    "sha256": "0" * 64,
                    "group_ids": group_ids,
                    "num_samples": 4 * len(group_ids),
                    "stats": {"reward_mean": 0.5},
                }
                if not separate_release:
                    submission["lease_id"] = grant["lease_id"]
                submitted = await timed("submit", "POST", "/v1/rollouts", submission)
                if submitted.status_code != 200:
                    outcome["refused" if submitted.status_code == 409 else "errors"] += 1
                if separate_release:
                    await timed("release", "DELETE", f"/v1/leases/{grant['lease_id']}")
                if submitted.status_code == 200:
                    nonlocal admitted
                    admitted += 1
                    if admitted % CHECK_EVERY == 0:
                        await check_durable(task["task_id"], grant["version"])
                if time.time() >= start_at and time.time() < stop_at and submitted.status_code == 200:
                    outcome["cycles"] += 1
            except httpx.HTTPError:
                outcome["errors"] += 1

    feed = asyncio.create_task(feeder())
    await asyncio.gather(*(worker(first + i) for i in range(count)))
    feed.cancel()
    await client.aclose()
    await broker.aclose()
    return {"latencies": latencies, **outcome}


def generate_process(args: tuple[str, str, str, int, int, float, float, bool], results: Any) -> None:
    cpu = time.process_time()
    outcome = asyncio.run(_generate_workers(*args))
    results.put({**outcome, "cpu_s": time.process_time() - cpu})


# ---- the simulated optimizer and the scraper (main process) ----


def publish_steps(bucket: Bucket, proxy_url: str, redis_url: str, stop_at: float, out: dict[str, Any]) -> None:
    """Take optimize tasks off the broker, write each version for real and publish it."""
    broker = redis.Redis.from_url(redis_url, decode_responses=True)
    client = httpx.Client(base_url=proxy_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30.0)
    while time.time() < stop_at:
        popped = broker.brpop([OPTIMIZE_QUEUE], timeout=1)
        if popped is None:
            continue
        step = decode_task(popped[1])
        version = step["step"]
        files = {"adapter_config.json": json.dumps({"r": 1, "version": version}).encode()}
        metadata = {"step": version, "base_version": step["base_version"], "worker_id": "sim-optimizer"}
        try:
            _, sha = write_version(bucket, RUN, version, files, metadata)
        except Exception:  # a re-sent step's version already exists: its publish answers as a retry
            continue
        request = {
            "version": version,
            "base_version": step["base_version"],
            "step": version,
            "worker_id": "sim-optimizer",
            "manifest_sha256": sha,
        }
        started = time.perf_counter()
        reply = client.post("/v1/versions", json=request)
        out["publish"].append(time.perf_counter() - started)
        out["published"] += reply.status_code == 200
