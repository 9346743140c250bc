"""Many generate workers against ONE real proxy process: lease -> submit -> release cycles per second.

Starts, privately: a ``redis-server``, a SeaweedFS S3 server (``--bucket s3``, the default) or a local folder
(``--bucket file``), creates a run as ``asyncgrpo run create`` does (``asyncgrpo.run.creation.create_run``), and starts
the proxy as an operator would (``python -m proxy`` with ``ASYNCGRPO_*`` variables, INFO logs to a file). Then
``--workers`` simulated generate workers (``proxy_load.py``: asyncio + httpx, spread over ``--procs`` processes
so that the load generator is not the bottleneck) each loop: take a real ``generate`` task message the proxy
dispatched from the Celery broker list in Redis, lease the current version, submit a rollout for exactly that
task's groups, release the lease; every ``CHECK_EVERY``-th admitted rollout is looked up in the snapshot in the
bucket right after its answer (durable before "admitted"). Each also heartbeats every ``HEARTBEAT_S``. A
simulated optimizer takes each ``optimize`` task from the broker, writes a small real version with
``asyncgrpo.bucket.layout.write_version`` and publishes it (``POST /v1/versions``), so the buffer drains and
dispatch goes on; ``/metrics`` is scraped once a second. The simulators write no rollout objects (the proxy
never reads them), so the bucket traffic is the proxy's.

Run config chosen so that the proxy is the bottleneck, not the simulators: one group per task (one cycle per
group), a large buffer (``queue_maxsize``) so there is always a task waiting in the broker, big steps so that
publishes are rare next to submits, ``max_staleness=16`` so fresh submits are not refused, and
``rollout_retention_versions=-1`` so the proxy does not delete rollout objects that were never written.

    python benchmarks/bench_proxy_scale.py [--workers 200] [--seconds 20] [--bucket s3|file] [--procs 2]

Prints cycles/s, p50/p95/p99 of each request kind, snapshot writes/s against submits/s (from the proxy's
``/metrics``), the proxy's and Redis's CPU time per cycle (the figure least disturbed by other load on a
shared machine: cycles/s on N free cores is at most about N / that), and one JSON line at the end. Asserts
nothing. Client-side latencies include any wait for a CPU in the load generator; the proxy's own view of each
request is the ``seconds`` of its ``proxy.request`` log lines (``--proxy-log``; those of heartbeats, renewals and
long polls only with ``ASYNCGRPO_LOG_LEVEL=DEBUG``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from proxy_load import KINDS, RUN, TOKEN, generate_process, publish_steps  # noqa: E402

from asyncgrpo.run.creation import create_run  # noqa: E402
from tests.support.fixtures_redis import free_port, start_redis_server  # noqa: E402
from tests.support.fixtures_s3 import open_env_bucket  # noqa: E402

GROUPS_PER_STEP = 128
CONFIG = f"""\
seed = 0
[dataset]
num_prompts = 20000
[optimizer]
total_steps = 1000000
[async]
groups_per_task = 1
groups_per_step = {GROUPS_PER_STEP}
queue_maxsize = 512
max_staleness = 16
rollout_retention_versions = -1
generate_task_timeout_s = 600
"""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process used so far (Linux /proc), the figure that noise on a shared
    machine disturbs least."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_commands(redis_url: str) -> dict[str, int]:
    """Calls per Redis command so far (``INFO commandstats``): everyone's, the load generator's broker reads and
    the publisher's included, so the figure per cycle is an upper bound on the proxy's round trips."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def scrape(proxy_url: str) -> tuple[dict[str, float], float]:
    started = time.perf_counter()
    text = httpx.get(f"{proxy_url}/metrics", timeout=30.0).text
    seconds = time.perf_counter() - started
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values, seconds


# ---- set-up ----


def start_services(workdir: Path, bucket_kind: str) -> tuple[list[subprocess.Popen], str, str, dict[str, str]]:
    """(processes to stop, redis URL, bucket URL, extra environment)."""
    server = start_redis_server(workdir)
    processes = [server.process]
    if bucket_kind == "file":
        return processes, server.url, f"file://{workdir / 'bucket'}", {}
    from tests.support.fixtures_s3 import start_seaweedfs

    (workdir / "weed").mkdir()
    weed, endpoint = start_seaweedfs(workdir / "weed")
    processes.append(weed)
    return processes, server.url, endpoint.bucket_url("bench"), endpoint.env()


def start_proxy(
    workdir: Path, redis_url: str, bucket_url: str, extra_env: dict[str, str]
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, **extra_env)
    env.update(
        {
            "ASYNCGRPO_REDIS_URL": redis_url,
            "ASYNCGRPO_BUCKET": bucket_url,
            "ASYNCGRPO_TOKEN": TOKEN,
            "ASYNCGRPO_RUN": RUN,
            "PYTHONPATH": str(ROOT),
        }
    )
    log = open(workdir / "proxy.log", "wb")  # noqa: SIM115 - the proxy writes to it until it is stopped
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=workdir,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the proxy exited: {(workdir / 'proxy.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the proxy did not become healthy within 60 s")


def stop_services(
    proxy: subprocess.Popen | None, processes: list[subprocess.Popen], workdir: Path, proxy_log: str | None
) -> None:
    """Stop the proxy (keeping its log at ``proxy_log``), then Redis and the bucket's server."""
    if proxy is not None:
        proxy.terminate()
        proxy.wait(timeout=30)
    if proxy_log:
        shutil.copy(workdir / "proxy.log", proxy_log)
    for process in processes:
        process.kill()
        process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--procs", type=int, default=2, help="load-generator processes")
    parser.add_argument("--bucket", choices=("s3", "file"), default="s3")
    parser.add_argument(
        "--separate-release",
        action="store_true",
        help="release each lease with its own DELETE instead of with the submission",
    )
    parser.add_argument("--proxy-log", default=None, help="keep the proxy's log at this path")
    parser.add_argument("--py-spy", dest="py_spy", default=None, help="record the proxy's stacks (raw) to this file")
    args = parser.parse_args()
    if args.py_spy and shutil.which("py-spy") is None:
        parser.error("--py-spy needs the py-spy profiler on PATH: pip install py-spy")

    with tempfile.TemporaryDirectory(prefix="bench-proxy-scale-") as tmp:
        workdir = Path(tmp)
        processes, redis_url, bucket_url, extra_env = start_services(workdir, args.bucket)
        proxy = None
        try:
            os.environ.update(extra_env)
            bucket = open_env_bucket(bucket_url)
            (workdir / "run.toml").write_text(CONFIG)
            create_run(workdir / "run.toml", RUN, bucket)
            proxy, proxy_url = start_proxy(workdir, redis_url, bucket_url, extra_env)
            start_at = time.time() + args.warmup
            stop_at = start_at + args.seconds
            ctx = multiprocessing.get_context("spawn")
            results = ctx.Queue()
            per_proc = [args.workers // args.procs + (i < args.workers % args.procs) for i in range(args.procs)]
            firsts = [sum(per_proc[:i]) for i in range(args.procs)]
            children = [
                ctx.Process(
                    target=generate_process,
                    args=(
                        (
                            proxy_url,
                            redis_url,
                            bucket_url,
                            firsts[i],
                            per_proc[i],
                            start_at,
                            stop_at,
                            args.separate_release,
                        ),
                        results,
                    ),
                )
                for i in range(args.procs)
            ]
            for child in children:
                child.start()
            optimizer: dict[str, Any] = {"publish": [], "published": 0}
            import threading

            publisher = threading.Thread(
                target=publish_steps, args=(bucket, proxy_url, redis_url, stop_at, optimizer), daemon=True
            )
            publisher.start()
            scrapes: list[float] = []
            while time.time() < start_at:
                time.sleep(0.05)
            spy = None
            if args.py_spy:
                spy = subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "--pid",
                        str(proxy.pid),
                        "--duration",
                        str(int(args.seconds)),
                        "--threads",
                        "--gil",  # only samples holding the GIL: the proxy's Python CPU, not its waits
                        "--format",
                        "raw",
                        "--output",
                        args.py_spy,
                        "--nonblocking",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            first_metrics, seconds = scrape(proxy_url)
            window_started = time.time()
            cpu_started = {"proxy": cpu_seconds(proxy.pid), "redis": cpu_seconds(processes[0].pid)}
            commands_started = redis_commands(redis_url)
            while time.time() < stop_at:
                time.sleep(1.0)
                last_metrics, seconds = scrape(proxy_url)
                scrapes.append(seconds)
            window = time.time() - window_started
            cpu = {"proxy": cpu_seconds(proxy.pid), "redis": cpu_seconds(processes[0].pid)}
            commands = redis_commands(redis_url)
            commands = {name: commands.get(name, 0) - commands_started.get(name, 0) for name in commands}
            cpu = {name: cpu[name] - cpu_started[name] for name in cpu}
            outcomes = [results.get(timeout=120) for _ in children]
            for child in children:
                child.join(timeout=30)
            publisher.join(timeout=30)
            if spy is not None:
                spy.wait(timeout=60)
        finally:
            stop_services(proxy, processes, workdir, args.proxy_log)

    latencies = {kind: [] for kind in KINDS}
    for outcome in outcomes:
        for kind, values in outcome["latencies"].items():
            latencies[kind].extend(values)
    latencies["publish"] = optimizer["publish"]
    latencies["metrics"] = scrapes
    cycles = sum(o["cycles"] for o in outcomes)

    def rate(name: str) -> float:
        return (last_metrics.get(name, 0.0) - first_metrics.get(name, 0.0)) / window

    figures: dict[str, Any] = {
        "bucket": args.bucket,
        "workers": args.workers,
        "procs": args.procs,
        "window_s": round(window, 1),
        "cycles_per_s": round(cycles / args.seconds, 1),
        "submits_per_s": round(rate("asyncgrpo_rollouts_admitted_total"), 1),
        "snapshot_writes_per_s": round(rate("asyncgrpo_snapshot_writes_total"), 1),
        "snapshot_compactions_per_s": round(rate("asyncgrpo_snapshot_compactions_total"), 2),
        "snapshot_kb_per_cycle": round(rate("asyncgrpo_snapshot_put_bytes_total") * window / 1024 / max(cycles, 1), 2),
        "versions_published": optimizer["published"],
        "proxy_cpu_ms_per_cycle": round(1000 * cpu["proxy"] / max(cycles, 1), 2),
        "redis_cpu_ms_per_cycle": round(1000 * cpu["redis"] / max(cycles, 1), 2),
        "proxy_cpu_share": round(cpu["proxy"] / window, 2),
        "load_generator_cpu_share": round(sum(o["cpu_s"] for o in outcomes) / (args.warmup + args.seconds), 2),
        "refused": sum(o["refused"] for o in outcomes),
        "durable_checked": sum(o["durable_checked"] for o in outcomes),
        "durable_missing": sum(o["durable_missing"] for o in outcomes),
        "errors": sum(o["errors"] for o in outcomes),
        "redis_commands_per_cycle": round(sum(commands.values()) / max(cycles, 1), 1),
        "redis_commands_top": {
            name: round(calls / max(cycles, 1), 2)
            for name, calls in sorted(commands.items(), key=lambda item: -item[1])[:8]
            if calls
        },
    }
    print(f"proxy scale: {args.workers} workers in {args.procs} processes, {args.bucket} bucket, {window:.1f} s")
    print(f"  cycles/s (lease+submit+release)  {figures['cycles_per_s']}")
    print(f"  submits admitted/s               {figures['submits_per_s']}")
    print(
        f"  snapshot writes/s                {figures['snapshot_writes_per_s']} "
        f"({figures['snapshot_compactions_per_s']} compactions/s; "
        f"{figures['snapshot_kb_per_cycle']} KB put per cycle)"
    )
    print(
        f"  proxy CPU per cycle              {figures['proxy_cpu_ms_per_cycle']} ms "
        f"(proxy used {figures['proxy_cpu_share']} of a core; Redis {figures['redis_cpu_ms_per_cycle']} ms/cycle; "
        f"load generator {figures['load_generator_cpu_share']} of a core)"
    )
    print(
        f"  Redis commands per cycle         {figures['redis_commands_per_cycle']} "
        f"(everyone's; top: {figures['redis_commands_top']})"
    )
    print(
        f"  versions published {figures['versions_published']}, refused {figures['refused']}, "
        f"errors {figures['errors']}"
    )
    print(
        f"  durable on answer: {figures['durable_checked'] - figures['durable_missing']} of "
        f"{figures['durable_checked']} sampled admitted rollouts were in the bucket's snapshot"
    )
    for kind in KINDS:
        values = latencies[kind]
        if not values:
            continue
        p50, p95, p99 = (percentile(values, q) * 1000 for q in (0.5, 0.95, 0.99))
        figures[f"{kind}_ms"] = {
            "n": len(values),
            "p50": round(p50, 2),
            "p95": round(p95, 2),
            "p99": round(p99, 2),
            "mean": round(statistics.fmean(values) * 1000, 2),
        }
        print(f"  {kind:<10} n={len(values):<7} p50 {p50:7.2f} ms  p95 {p95:7.2f} ms  p99 {p99:7.2f} ms")
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
