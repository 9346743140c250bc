"""A fleet of simulated generate workers against ONE real proxy, Redis and bucket, from one asyncio process.

Starts, privately, a ``redis-server``, a SeaweedFS S3 server (``--bucket s3``, the default) or a local folder
(``--bucket file``) and the proxy as an operator would (``python -m proxy``), creates a run, then simulates in
this process ``--workers`` generate workers as the real ones behave towards the proxy:

- each takes a real ``generate`` task message the proxy dispatched from the broker list in Redis (one feeder,
  as Celery's prefetch would), leases the current version with its incarnation, "generates" for a service time
  drawn around ``--task-s`` (renewing its lease every third of the lease TTL when that is longer), writes a
  rollout object of ``--rollout-kb`` to the bucket, and submits it naming the lease;
- each heartbeats every 5 s (the workers' default) and holds a long poll on ``/v1/versions/latest`` (the
  adapter prefetcher), so the proxy carries ``--workers`` open polls;
- ``--deaths-per-min`` workers die at random mid-task (no submit, heartbeats stop; the broker redelivers
  their message after ``--visibility-s``), and come back ``--rejoin-s`` later, half as a restart under the same
  worker id (a new incarnation) and half as a new worker id.

A simulated trainer takes each ``optimize`` task, "trains" for ``--step-s``, writes a small real version and
publishes it, recording the staleness of every rollout it trains (``base_version - rollout version``) and the
time it waits for a step (its idle share). ``/metrics`` is scraped every 2 s.

It prints cycles/s (admitted lease + submit cycles), p50/p99 of each request kind, the proxy's and Redis's CPU per
cycle and this process's own CPU share, the audit (every admitted rollout trained, still buffered or in the
step in flight in the bucket's snapshot, or dropped as stale at a claim, as Redis records; no group trained
twice), the staleness distribution, the trainer's idle share, and the proxy's
``asyncgrpo_generate_workers_wanted`` against the trainer-bound arithmetic from the measured task and step
times. ``--rates`` runs the fleet at several offered rates (cycles/s, by setting the task time) and reports
where the p99 of lease or submit crosses 50 ms: the proxy's capacity. Asserts nothing.

    python benchmarks/bench_fleet.py [--workers 1000] [--task-s 3.3] [--step-s 1.7] [--seconds 30] [--bucket s3|file]
    python benchmarks/bench_fleet.py --rates 100,200,300 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402
from bench_proxy_scale import (  # noqa: E402
    cpu_seconds,
    percentile,
    start_proxy,
    start_services,
    stop_services,
)
from proxy_load import GENERATE_QUEUE, OPTIMIZE_QUEUE, RUN, TOKEN, decode_task  # noqa: E402

from asyncgrpo.bucket import layout as bucket_keys  # noqa: E402
from asyncgrpo.bucket.layout import write_version  # noqa: E402
from asyncgrpo.run.creation import create_run  # noqa: E402
from proxy.coordinator.redis_store import RunKeys  # noqa: E402
from tests.support.fixtures_s3 import open_env_bucket  # noqa: E402

HEARTBEAT_S = 5.0
"""The generate workers' default (``ASYNCGRPO_HEARTBEAT_S``)."""
LONG_POLL_S = 20.0
"""The prefetcher's default wait (``ASYNCGRPO_PREFETCH_WAIT_S``)."""
LEASE_TTL_S = 60.0
"""``async.lease_ttl_s``'s default; a real worker renews every third of it."""
P99_LIMIT_MS = 50.0
KINDS = ("lease", "submit", "renew", "heartbeat", "publish")


@dataclass
class Fleet:
    """What the simulation saw, across all workers."""

    start_at: float
    stop_at: float
    latencies: dict[str, list[float]] = field(default_factory=lambda: {kind: [] for kind in KINDS})
    admitted: set[str] = field(default_factory=set)
    admitted_groups: Counter[str] = field(default_factory=Counter)
    cycles: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    task_s: list[float] = field(default_factory=list)
    deaths: int = 0
    restarts: int = 0
    joins: int = 0
    polls: int = 0
    # the trainer
    trained: set[str] = field(default_factory=set)
    trained_groups: Counter[str] = field(default_factory=Counter)
    staleness: Counter[int] = field(default_factory=Counter)
    step_s: list[float] = field(default_factory=list)
    trainer_idle_s: float = 0.0
    published: int = 0
    scrapes: list[dict[str, float]] = field(default_factory=list)

    def in_window(self) -> bool:
        return self.start_at <= time.time() < self.stop_at


class Answer:
    """An HTTP answer: status and body."""

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body) if self.body else {}


class ConnectionFailed(Exception):
    """The connection broke or timed out; it is closed and opened again by the next request."""


class Connection:
    """One keep-alive HTTP/1.1 connection to the proxy, one request at a time. httpx costs about a millisecond of
    CPU per request, which at 1,000 workers made the simulator, not the proxy, the bottleneck (it saturated its
    core while the proxy idled); this costs a small fraction of that. The proxy answers with Content-Length."""

    def __init__(self, url: str) -> None:
        host_port = url.removeprefix("http://")
        self.host, port = host_port.split(":")
        self.port = int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: Any = None, timeout: float = 60.0) -> Answer:
        for attempt in (1, 2):
            reused = self.writer is not None
            try:
                return await asyncio.wait_for(self._request(method, path, body), timeout)
            except (ConnectionError, asyncio.IncompleteReadError) as error:
                self.close()
                if reused and attempt == 1:
                    continue  # the server closed the idle connection as we reused it: as httpx, try a new one
                raise ConnectionFailed(type(error).__name__) from error
            except (OSError, asyncio.LimitOverrunError, TimeoutError, ValueError) as error:
                self.close()
                raise ConnectionFailed(type(error).__name__) from error
        raise AssertionError("unreachable")

    async def _request(self, method: str, path: str, body: Any) -> Answer:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        self.writer.write(head.encode() + payload)
        header = await self.reader.readuntil(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length, close = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                close = True
        data = await self.reader.readexactly(length) if length else b""
        if close:
            self.close()
        return Answer(status, data)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def service_time(mean_s: float, rng: random.Random) -> float:
    """A task's service time: log-normal with the given mean (sigma 0.25: most tasks within +-50 %)."""
    sigma = 0.25
    return mean_s * math.exp(rng.gauss(0.0, sigma) - sigma * sigma / 2)


class Simulation:
    def __init__(self, args: argparse.Namespace, proxy_url: str, redis_url: str, bucket_url: str) -> None:
        self.args = args
        self.redis_url = redis_url
        self.bucket = open_env_bucket(bucket_url)
        self.proxy_url = proxy_url
        self.broker = aioredis.Redis.from_url(redis_url, decode_responses=True)
        self.tasks: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self.rng = random.Random(0)
        self.payload = os.urandom(args.rollout_kb * 1024)
        start_at = time.time() + args.warmup
        self.fleet = Fleet(start_at=start_at, stop_at=start_at + args.seconds)
        self.next_worker = args.workers
        self.redeliveries: set[asyncio.Task[None]] = set()
        # Deaths are drawn per task: the fleet-wide rate over the task rate the fleet makes.
        offered = args.workers / args.task_s
        self.death_p = min(0.5, args.deaths_per_min / 60 / offered)

    async def timed(self, conn: Connection, kind: str, method: str, path: str, body: Any = None) -> Answer:
        started = time.perf_counter()
        response = await conn.request(method, path, body)
        if self.fleet.in_window() and kind in self.fleet.latencies:
            self.fleet.latencies[kind].append(time.perf_counter() - started)
        return response

    # ---- the broker ----

    async def feeder(self) -> None:
        while time.time() < self.fleet.stop_at:
            if self.tasks.qsize() >= self.args.workers:
                await asyncio.sleep(0.01)
                continue
            popped = await self.broker.brpop([GENERATE_QUEUE], timeout=1)
            if popped is None:
                continue
            raws = [popped[1], *(await self.broker.rpop(GENERATE_QUEUE, 64) or [])]
            for raw in raws:
                self.tasks.put_nowait((raw, decode_task(raw)))

    async def redeliver(self, raw: str) -> None:
        # Celery acks late: a message whose worker died comes back after the visibility timeout.
        await asyncio.sleep(self.args.visibility_s)
        await self.broker.lpush(GENERATE_QUEUE, raw)

    # ---- a generate worker ----

    async def worker_slot(self, index: int) -> None:
        worker_id = f"sim-gen-{index:05d}"
        await asyncio.sleep(self.rng.random() * HEARTBEAT_S)  # workers did not all start in the same second
        while time.time() < self.fleet.stop_at:
            incarnation = uuid.uuid4().hex[:16]
            died = await self.incarnation(worker_id, incarnation)
            if not died:
                return
            await asyncio.sleep(self.args.rejoin_s)
            if self.rng.random() < 0.5:
                self.fleet.restarts += 1  # its unit restarts it under the same worker id
            else:
                self.fleet.joins += 1  # a fresh spot machine
                worker_id = f"sim-gen-{self.next_worker:05d}"
                self.next_worker += 1

    async def incarnation(self, worker_id: str, incarnation: str) -> bool:
        """Run one worker process until the window ends (False) or it dies (True)."""
        # A process's connections: its task's, its heartbeat thread's and its prefetcher's long poll.
        work, beat_conn, poll_conn = (Connection(self.proxy_url) for _ in range(3))
        beat = asyncio.create_task(self.heartbeats(beat_conn, worker_id, incarnation))
        poll = asyncio.create_task(self.long_poll(poll_conn))
        try:
            while time.time() < self.fleet.stop_at:
                try:
                    raw, task = await asyncio.wait_for(self.tasks.get(), timeout=1.0)
                except TimeoutError:
                    continue
                if self.rng.random() < self.death_p:
                    await asyncio.sleep(service_time(self.args.task_s, self.rng) * self.rng.random())
                    self.fleet.deaths += 1
                    self.redeliveries.add(asyncio.create_task(self.redeliver(raw)))
                    return True
                await self.run_task(work, worker_id, incarnation, task)
            return False
        finally:
            beat.cancel()
            poll.cancel()
            for conn in (work, beat_conn, poll_conn):
                conn.close()

    async def run_task(self, conn: Connection, worker_id: str, incarnation: str, task: dict[str, Any]) -> None:
        fleet = self.fleet
        task_id = task["task_id"]
        started = time.perf_counter()
        try:
            request = {"worker_id": worker_id, "task_id": task_id, "incarnation": incarnation}
            answer = await self.timed(conn, "lease", "POST", "/v1/leases", request)
            if answer.status != 200:
                fleet.refused[f"lease:{answer.json().get('error', answer.status)}"] += 1
                return
            grant = answer.json()
            remaining = service_time(self.args.task_s, self.rng)
            renew_every = LEASE_TTL_S / 3
            while remaining > renew_every:
                await asyncio.sleep(renew_every)
                remaining -= renew_every
                await self.timed(conn, "renew", "POST", f"/v1/leases/{grant['lease_id']}/renew", {})
            await asyncio.sleep(remaining)
            key = bucket_keys.rollout_key(RUN, task_id)
            if self.args.rollout_kb:
                await asyncio.to_thread(self.bucket.put, key, self.payload)
            group_ids = [group["group_id"] for group in task["groups"]]
            submission = {
                "task_id": task_id,
                "worker_id": worker_id,
                "version": grant["version"],
                "key": key,
                "sha256": "0" * 64,
                "group_ids": group_ids,
                "num_samples": 8 * len(group_ids),
                "stats": {"reward_mean": 0.5},
                "lease_id": grant["lease_id"],
            }
            submitted = await self.timed(conn, "submit", "POST", "/v1/rollouts", submission)
        except ConnectionFailed as error:
            fleet.errors[str(error)] += 1
            return
        if submitted.status != 200:
            fleet.refused[f"submit:{submitted.json().get('error', submitted.status)}"] += 1
            return
        fleet.admitted.add(task_id)
        fleet.admitted_groups.update(group_ids)
        fleet.task_s.append(time.perf_counter() - started)
        if fleet.in_window():
            fleet.cycles += 1

    async def heartbeats(self, conn: Connection, worker_id: str, incarnation: str) -> None:
        report = {
            "worker_id": worker_id,
            "role": "generate",
            "hostname": "fleet",
            "pid": os.getpid(),
            "incarnation": incarnation,
            "state": "generating",
        }
        while True:
            try:
                await self.timed(conn, "heartbeat", "POST", "/v1/workers/heartbeat", report)
            except ConnectionFailed as error:
                self.fleet.errors[f"heartbeat:{error}"] += 1
            await asyncio.sleep(HEARTBEAT_S)

    async def long_poll(self, conn: Connection) -> None:
        after = -1
        while True:
            try:
                path = f"/v1/versions/latest?after={after}&wait_s={LONG_POLL_S}"
                answer = await conn.request("GET", path, timeout=LONG_POLL_S + 30)
                after = int(answer.json()["version"])
                self.fleet.polls += 1
            except (ConnectionFailed, KeyError, ValueError) as error:
                self.fleet.errors[f"poll:{error}"] += 1
                await asyncio.sleep(1.0)

    # ---- the trainer and the scraper ----

    async def trainer(self) -> None:
        fleet = self.fleet
        conn = Connection(self.proxy_url)
        ready = time.time()
        while time.time() < fleet.stop_at:
            popped = await self.broker.brpop([OPTIMIZE_QUEUE], timeout=1)
            if popped is None:
                continue
            got = time.time()
            if got > fleet.start_at:
                fleet.trainer_idle_s += min(got, fleet.stop_at) - max(ready, fleet.start_at)
            step = decode_task(popped[1])
            version, base = step["step"], step["base_version"]
            await asyncio.sleep(self.args.step_s if version > 0 else 0.0)
            files = {"adapter_config.json": json.dumps({"r": 1, "version": version}).encode()}
            metadata = {"step": version, "base_version": base, "worker_id": "sim-trainer"}
            try:
                _, sha = await asyncio.to_thread(write_version, self.bucket, RUN, version, files, metadata)
            except Exception:  # a re-sent step whose version exists: its publish answers as a retry
                ready = time.time()
                continue
            request = {
                "version": version,
                "base_version": base,
                "step": version,
                "worker_id": "sim-trainer",
                "manifest_sha256": sha,
            }
            try:
                reply = await self.timed(conn, "publish", "POST", "/v1/versions", request)
            except ConnectionFailed as error:
                fleet.errors[f"publish:{error}"] += 1
                continue
            ready = time.time()
            if reply.status != 200:
                continue
            fleet.published += 1
            if version > 0:
                fleet.step_s.append(ready - got)
            for rollout in step["rollouts"]:
                fleet.trained.add(rollout["task_id"])
                fleet.trained_groups.update(rollout["group_ids"])
                fleet.staleness[base - rollout["version"]] += 1

    async def scraper(self) -> None:
        conn = Connection(self.proxy_url)
        while time.time() < self.fleet.stop_at:
            await asyncio.sleep(2.0)
            try:
                text = (await conn.request("GET", "/metrics")).body.decode()
            except ConnectionFailed:
                continue
            values = {}
            for line in text.splitlines():
                if line.startswith("asyncgrpo_") and "{" not in line:
                    name, _, value = line.rpartition(" ")
                    values[name] = float(value)
            values["t"] = time.time()
            self.fleet.scrapes.append(values)

    async def run(self) -> Fleet:
        background = [asyncio.create_task(self.feeder()), asyncio.create_task(self.scraper())]
        trainer = asyncio.create_task(self.trainer())
        slots = [asyncio.create_task(self.worker_slot(i)) for i in range(self.args.workers)]
        await asyncio.gather(*slots, return_exceptions=True)
        await trainer
        for job in [*background, *self.redeliveries]:
            job.cancel()
        await self.broker.aclose()
        return self.fleet


# ---- the audit ----


def audit(fleet: Fleet, redis_url: str, bucket_url: str) -> dict[str, Any]:
    """Every admitted rollout is trained, in the bucket's snapshot (buffered or in the step in flight), or was
    dropped as stale at a claim (Redis says so); no group is trained or admitted twice."""
    import redis as sync_redis

    from proxy.coordinator.snapshot import load_snapshot

    document = load_snapshot(open_env_bucket(bucket_url), RUN) or {}
    held = {entry["task_id"] for entry in document.get("buffer", [])}
    step = document.get("step") or {}
    for ref in json.loads((step.get("record") or {}).get("rollouts", "[]")):
        held.add(ref["task_id"])
    unaccounted = fleet.admitted - fleet.trained - held
    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    keys = RunKeys(RUN)
    dropped_stale = {t for t in unaccounted if client.hget(keys.rollout(t), "state") == "stale"}
    client.close()
    return {
        "admitted": len(fleet.admitted),
        "trained": len(fleet.trained & fleet.admitted),
        "in_snapshot": len(held & fleet.admitted),
        "dropped_stale_at_claim": len(dropped_stale),
        "lost": len(unaccounted - dropped_stale),
        "groups_trained_twice": sum(1 for count in fleet.trained_groups.values() if count > 1),
        "groups_admitted_twice": sum(1 for count in fleet.admitted_groups.values() if count > 1),
    }


# ---- one run of the fleet ----


def config_text(args: argparse.Namespace) -> str:
    return f"""\
seed = 0
[dataset]
num_prompts = 1000000
[optimizer]
total_steps = 1000000
[async]
groups_per_task = {args.groups_per_task}
groups_per_step = {args.groups_per_step}
queue_maxsize = {args.queue_maxsize}
max_staleness = {args.max_staleness}
generate_task_timeout_s = 600
"""


def run_fleet(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        workdir = Path(tmp)
        processes, redis_url, bucket_url, extra_env = start_services(workdir, args.bucket)
        proxy = None
        try:
            os.environ.update(extra_env)
            (workdir / "run.toml").write_text(config_text(args))
            create_run(workdir / "run.toml", RUN, open_env_bucket(bucket_url))
            proxy, proxy_url = start_proxy(workdir, redis_url, bucket_url, extra_env)
            simulation = Simulation(args, proxy_url, redis_url, bucket_url)
            fleet = simulation.fleet

            async def measured() -> tuple[Fleet, dict[str, float], float]:
                job = asyncio.create_task(simulation.run())
                await asyncio.sleep(max(0.0, fleet.start_at - time.time()))
                if args.py_spy:  # the proxy's GIL-holding stacks over the window, raw (folded) format
                    spy = ["py-spy", "record", "--pid", str(proxy.pid), "--duration", str(int(args.seconds))]
                    spy += ["--threads", "--gil", "--nonblocking", "--format", "raw", "--output", args.py_spy]
                    subprocess.Popen(spy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                cpu_at = {"proxy": cpu_seconds(proxy.pid), "redis": cpu_seconds(processes[0].pid)}
                own_at = time.process_time()
                await asyncio.sleep(max(0.0, fleet.stop_at - time.time()))
                cpu = {
                    "proxy": cpu_seconds(proxy.pid) - cpu_at["proxy"],
                    "redis": cpu_seconds(processes[0].pid) - cpu_at["redis"],
                }
                own = time.process_time() - own_at
                return await job, cpu, own

            fleet, cpu, own_cpu = asyncio.run(measured())
            checked = audit(fleet, redis_url, bucket_url)
        finally:
            stop_services(proxy, processes, workdir, args.proxy_log)
    return summarize(args, fleet, cpu, own_cpu, checked)


def summarize(
    args: argparse.Namespace, fleet: Fleet, cpu: dict[str, float], own_cpu: float, checked: dict[str, Any]
) -> dict[str, Any]:
    window = args.seconds
    cycles = max(fleet.cycles, 1)
    figures: dict[str, Any] = {
        "bucket": args.bucket,
        "workers": args.workers,
        "task_s": args.task_s,
        "step_s": args.step_s,
        "offered_cycles_per_s": round(args.workers / args.task_s, 1),
        "cycles_per_s": round(fleet.cycles / window, 1),
        "proxy_cpu_ms_per_cycle": round(1000 * cpu["proxy"] / cycles, 2),
        "redis_cpu_ms_per_cycle": round(1000 * cpu["redis"] / cycles, 2),
        "proxy_cpu_share": round(cpu["proxy"] / window, 2),
        "simulator_cpu_share": round(own_cpu / window, 2),
        "refused": dict(fleet.refused),
        "errors": dict(fleet.errors),
        "deaths": fleet.deaths,
        "restarts": fleet.restarts,
        "joins": fleet.joins,
        "long_polls_answered": fleet.polls,
        "versions_published": fleet.published,
        "audit": checked,
    }
    for kind in KINDS:
        values = fleet.latencies[kind]
        if values:
            figures[f"{kind}_ms"] = {
                "n": len(values),
                "p50": round(percentile(values, 0.5) * 1000, 1),
                "p99": round(percentile(values, 0.99) * 1000, 1),
            }
    trained = max(1, sum(fleet.staleness.values()))
    figures["staleness"] = {str(k): round(v / trained, 3) for k, v in sorted(fleet.staleness.items())}
    figures["trainer_idle_share"] = round(fleet.trainer_idle_s / window, 3)
    # The proxy's wanted count (the last half of the window) against the arithmetic from what the simulation
    # measured: tasks per version * (task service time + delivery) / step time.
    late = [s for s in fleet.scrapes if s["t"] >= fleet.start_at + window / 2]
    wanted = [s["asyncgrpo_generate_workers_wanted"] for s in late if "asyncgrpo_generate_workers_wanted" in s]
    if wanted and fleet.task_s and fleet.step_s:
        tasks_per_version = math.ceil(args.groups_per_step / args.groups_per_task)
        expected = tasks_per_version * (statistics.median(fleet.task_s) + 0.01) / statistics.median(fleet.step_s)
        figures["workers_wanted"] = statistics.median(wanted)
        figures["workers_wanted_arithmetic"] = round(expected, 1)
        figures["workers_wanted_ratio"] = round(statistics.median(wanted) / expected, 2)
    # What the snapshot's group commits put, per admitted cycle, over the window (segments and compactions).
    window_scrapes = [s for s in fleet.scrapes if fleet.start_at <= s["t"] <= fleet.stop_at]
    if len(window_scrapes) >= 2:
        first, last = window_scrapes[0], window_scrapes[-1]
        cycles_between = max(1.0, fleet.cycles * (last["t"] - first["t"]) / window)

        def grew(name: str) -> float:
            return last.get(name, 0.0) - first.get(name, 0.0)

        figures["snapshot_kb_per_cycle"] = round(grew("asyncgrpo_snapshot_put_bytes_total") / 1024 / cycles_between, 2)
        figures["snapshot_puts_per_s"] = round(grew("asyncgrpo_snapshot_writes_total") / (last["t"] - first["t"]), 1)
        figures["snapshot_compactions"] = int(grew("asyncgrpo_snapshot_compactions_total"))
    submitting = [s.get("asyncgrpo_generate_workers_submitting") for s in late]
    if submitting and submitting[-1] is not None:
        figures["workers_submitting"] = submitting[-1]
    return figures


def report(figures: dict[str, Any]) -> None:
    print(
        f"fleet: {figures['workers']} workers, task {figures['task_s']} s (offered {figures['offered_cycles_per_s']}"
        f" cycles/s), step {figures['step_s']} s, {figures['bucket']} bucket"
    )
    print(f"  cycles/s (lease + submit, admitted)  {figures['cycles_per_s']}")
    print(
        f"  proxy CPU per cycle                  {figures['proxy_cpu_ms_per_cycle']} ms (proxy used "
        f"{figures['proxy_cpu_share']} of a core; Redis {figures['redis_cpu_ms_per_cycle']} ms/cycle; this "
        f"simulator {figures['simulator_cpu_share']} of a core)"
    )
    for kind in KINDS:
        if f"{kind}_ms" in figures:
            f = figures[f"{kind}_ms"]
            print(f"  {kind:<10} n={f['n']:<7} p50 {f['p50']:8.1f} ms  p99 {f['p99']:8.1f} ms")
    print(
        f"  deaths {figures['deaths']} (restarted {figures['restarts']}, new ids {figures['joins']}), "
        f"long polls answered {figures['long_polls_answered']}, versions {figures['versions_published']}"
    )
    print(f"  refused {figures['refused']}, errors {figures['errors']}")
    if "snapshot_kb_per_cycle" in figures:
        print(
            f"  snapshot puts/s {figures['snapshot_puts_per_s']} ({figures['snapshot_compactions']} compactions in "
            f"the window), {figures['snapshot_kb_per_cycle']} KB put per cycle"
        )
    print(f"  audit {figures['audit']}")
    print(f"  staleness of trained rollouts {figures['staleness']}; trainer idle {figures['trainer_idle_share']}")
    if "workers_wanted" in figures:
        print(
            f"  workers wanted {figures['workers_wanted']} (proxy) vs {figures['workers_wanted_arithmetic']} "
            f"(arithmetic): ratio {figures['workers_wanted_ratio']}; submitting {figures.get('workers_submitting')}"
        )
    print(json.dumps(figures, sort_keys=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--task-s", type=float, default=3.3, help="mean generate task service time")
    parser.add_argument("--step-s", type=float, default=1.7, help="the simulated trainer's time per step")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--bucket", choices=("s3", "file"), default="s3")
    parser.add_argument("--rollout-kb", type=int, default=64, help="size of each rollout object written")
    parser.add_argument("--groups-per-task", type=int, default=2)
    parser.add_argument("--groups-per-step", type=int, default=1024)
    parser.add_argument("--queue-maxsize", type=int, default=4096)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--deaths-per-min", type=float, default=10.0, help="fleet-wide")
    parser.add_argument("--rejoin-s", type=float, default=5.0)
    parser.add_argument("--visibility-s", type=float, default=60.0, help="the broker's redelivery delay")
    parser.add_argument("--py-spy", dest="py_spy", default=None, help="record the proxy's stacks (raw) here")
    parser.add_argument("--proxy-log", default=None, help="keep the proxy's log at this path")
    parser.add_argument("--rates", default=None, help="offered cycles/s to sweep (sets --task-s per run)")
    args = parser.parse_args()
    if args.py_spy and shutil.which("py-spy") is None:
        parser.error("--py-spy needs the py-spy profiler on PATH: pip install py-spy")

    if not args.rates:
        report(run_fleet(args))
        return
    rows = []
    warmup, seconds = args.warmup, args.seconds
    for rate in (float(r) for r in args.rates.split(",")):
        args.task_s = args.workers / rate
        # The trainer keeps pace with the offered rate, so the proxy, not the trainer, is what is measured.
        args.step_s = args.groups_per_step / args.groups_per_task / rate
        # Past the start-up wave (every worker's first task ends at about the same time) and over two tasks.
        args.warmup, args.seconds = max(warmup, 1.5 * args.task_s), max(seconds, 2 * args.task_s)
        figures = run_fleet(args)
        report(figures)
        rows.append(figures)
    print("capacity: offered -> served cycles/s, p99 lease / submit / heartbeat (ms)")
    crossed = None
    for f in rows:
        p99 = [f.get(f"{k}_ms", {}).get("p99", float("nan")) for k in ("lease", "submit", "heartbeat")]
        print(f"  {f['offered_cycles_per_s']:>7} -> {f['cycles_per_s']:>7}   " + " / ".join(f"{v:.1f}" for v in p99))
        if crossed is None and max(p99[:2]) > P99_LIMIT_MS:
            crossed = f["offered_cycles_per_s"]
    print(f"  p99 of lease or submit first above {P99_LIMIT_MS:.0f} ms at {crossed} cycles/s offered")


if __name__ == "__main__":
    main()
