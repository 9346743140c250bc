"""What the proxy's run-level metrics cost, against a private local redis-server and a file:// bucket.

- the bottleneck accounting that ends every ``tick()`` (one HMGET, plus one counter script per condition
  that held), next to the whole idle ``tick()`` it is part of;
- a lease (and its release, so that leases do not pile up): the first one on a new version (which reads
  the publish time and marks the first use) and a later one (which costs nothing extra: the process
  remembers the version is marked);
- rendering ``/metrics`` (``generate_latest`` of the proxy's registry, state read from Redis).

    python benchmarks/bench_proxy_metrics.py [--rounds 2000]

Prints microseconds per call (mean, p50, p95).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
import structlog
from prometheus_client import generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.coordinator.service import Coordinator
from tests.support.fixtures_redis import start_redis_server
from tests.support.proxy_harness import ManualClock, file_bucket, make_coordinator, publish_next, submission


def timed(label: str, rounds: int, call: Callable[[], object], between: Callable[[], object] | None = None) -> None:
    samples = []
    for _ in range(rounds):
        if between is not None:
            between()
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e6)
    samples.sort()
    p95 = samples[int(0.95 * (len(samples) - 1))]
    print(
        f"{label:<44} n={rounds:<5} mean={statistics.fmean(samples):8.1f} us  "
        f"p50={statistics.median(samples):8.1f} us  p95={p95:8.1f} us"
    )


def publish_new_version(coord: Coordinator) -> None:
    """Fill a step from the dispatched tasks, claim it and publish it (untimed set-up of a first lease)."""
    for task in coord.dispatcher.generate:
        if coord.redis.hget(coord.keys.task(task["task_id"]), "state") != "inflight":
            continue
        coord.submit(submission(coord, task, coord.current_version()))
    coord.tick()
    publish_next(coord)
    coord.tick()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as workdir:
        server = start_redis_server(Path(workdir))
        try:
            client = redis.Redis.from_url(server.url, decode_responses=True)
            clock = ManualClock()
            coord = make_coordinator(client, file_bucket(Path(workdir)), clock=clock)
            coord.metrics.watch_state(coord.status, coord.run_limits())  # as create_app does
            coord.tick()
            publish_next(coord)
            coord.tick()  # buffer full, no step: both waiting conditions hold, so both counters are written

            def advance() -> None:
                clock.advance(0.01)  # ticks stay idle: no lease or task deadline is reached

            timed("tick() accounting (WaitingAccount.account)", args.rounds, coord.accounting.account, advance)
            timed("whole idle tick()", args.rounds, coord.tick, advance)

            def lease_and_release() -> None:
                coord.release(coord.lease("bench", "t").lease_id)

            timed("lease+release, not the first on its version", args.rounds, lease_and_release)
            first_rounds = max(10, args.rounds // 50)
            timed(
                "lease+release, first on a new version",
                first_rounds,
                lease_and_release,
                lambda: publish_new_version(coord),
            )
            timed("render /metrics", max(10, args.rounds // 10), lambda: generate_latest(coord.metrics.registry))
            client.close()
        finally:
            server.process.terminate()
            server.process.wait(timeout=10)


if __name__ == "__main__":
    main()
