"""Worker heartbeats: each worker's last report and incarnation, and the list ``/v1/workers`` shows.

A worker is alive while its last heartbeat is at most ``worker_alive_s`` old; one silent for
``WORKER_FORGET_S`` disappears from the list, and its record expires then too.

A heartbeat names the worker process's incarnation (``asyncgrpo.protocol.incarnation``). A new incarnation of a
known worker id is a restart under the same id (systemd's ``Restart=on-failure``): its heartbeats never stop,
so the old process's work is ended by incarnation, not by silence. The heartbeat itself ends the old
incarnation's leases; the next housekeeping round, which the app runs at once, ends its generate task
(``generate_tasks``), its evaluate task (``evaluations``) and has its step sent again (``step_sending``).
"""

from __future__ import annotations

import json

import structlog

from asyncgrpo.protocol.schemas import HeartbeatRequest, WorkerRecord
from proxy.coordinator.store import RunStore

log = structlog.get_logger()

WORKER_FORGET_S = 3600.0
"""A worker silent this long disappears from ``/v1/workers``."""


class Workers:
    """The heartbeats of one run's workers."""

    def __init__(self, store: RunStore, alive_s: float) -> None:
        self.store = store
        self.alive_s = alive_s

    def heartbeat(self, report: HeartbeatRequest) -> bool:
        """Record ``report``; True if it is the first of a new incarnation of a known worker id (restarted)."""
        reply = self.store.scripts.record_heartbeat(
            now_ms=self.store.clock_ms(),
            worker_id=report.worker_id,
            report_json=report.model_dump_json(),
            forget_after_ms=int(WORKER_FORGET_S * 1000),
            # Not the run's record TTL (days): a worker id heard from once, or made up, is gone in an hour.
            record_ttl_s=int(WORKER_FORGET_S),
            role=report.role,
            incarnation=report.incarnation or "",
        )
        restarted = int(reply["restarted"]) == 1
        if restarted:
            log.warning(
                "proxy.worker_restarted",
                worker_id=report.worker_id,
                role=report.role,
                incarnation=report.incarnation,
                leases_ended=int(reply["leases_ended"]),
            )
        return restarted

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
            pipe.hmget(store.keys.worker(worker_id), ["report", "last_seen_ms", "incarnation", "restarts"])
        out = []
        for report, last_seen, incarnation, restarts in pipe.execute():
            if report is None:
                continue
            seen = int(last_seen)
            out.append(
                WorkerRecord(
                    **{**json.loads(report), "incarnation": incarnation},
                    restarts=int(restarts or 0),
                    last_seen=seen / 1000.0,
                    alive=now - seen <= self.alive_s * 1000,
                )
            )
        return out
