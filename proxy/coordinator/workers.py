"""Worker heartbeats: each worker's last report, and the list ``/v1/workers`` shows.

A worker is alive while its last heartbeat is at most ``worker_alive_s`` old; one silent for
``WORKER_FORGET_S`` disappears from the list, and its record expires then too.
"""

from __future__ import annotations

import json

from proxy.coordinator.store import RunStore
from proxy.protocol.schemas import HeartbeatRequest, WorkerRecord

WORKER_FORGET_S = 3600.0
"""A worker silent this long disappears from ``/v1/workers``."""


class Workers:
    """The heartbeats of one run's workers."""

    def __init__(self, store: RunStore, alive_s: float) -> None:
        self.store = store
        self.alive_s = alive_s

    def heartbeat(self, report: HeartbeatRequest) -> None:
        self.store.scripts.record_heartbeat(
            now_ms=self.store.clock_ms(),
            worker_id=report.worker_id,
            report_json=report.model_dump_json(),
            forget_after_ms=int(WORKER_FORGET_S * 1000),
            # Not the run's record TTL (days): a worker id heard from once, or made up, is gone in an hour.
            record_ttl_s=int(WORKER_FORGET_S),
            role=report.role,
        )

    def alive_count(self, role: str) -> int:
        """Workers of ``role`` heard from within ``alive_s`` (one ZCOUNT)."""
        store = self.store
        key = store.keys.workers_optimize if role == "optimize" else store.keys.workers_generate
        return int(store.redis.zcount(key, store.clock_ms() - int(self.alive_s * 1000), "+inf"))

    def list(self) -> list[WorkerRecord]:
        """Every worker heard from within ``WORKER_FORGET_S``, with its last report."""
        store = self.store
        now = store.clock_ms()
        ids = store.redis.zrange(store.keys.workers, 0, -1)
        pipe = store.redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hmget(store.keys.worker(worker_id), ["report", "last_seen_ms"])
        out = []
        for report, last_seen in pipe.execute():
            if report is None:
                continue
            seen = int(last_seen)
            out.append(
                WorkerRecord(
                    **json.loads(report),
                    last_seen=seen / 1000.0,
                    alive=now - seen <= self.alive_s * 1000,
                )
            )
        return out
