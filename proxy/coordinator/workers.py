"""The fleet's heartbeats: each worker's last report, liveness by role, and restarts told apart by incarnation.

Every worker sends one every few seconds (``POST /v1/workers/heartbeat``); the record lives one hour after the
last (``WORKER_FORGET_S``), so ``/v1/workers`` lists who was heard from lately. A report of a new incarnation
under a known worker id is a restart: ``record_heartbeat.lua`` ends the old incarnation's leases, tasks and step
at once, and the caller runs a housekeeping round.
"""

from __future__ import annotations

import json
from typing import Any

import structlog

from asyncgrpo.protocol.schemas import HeartbeatRequest, WorkerRecord
from proxy.coordinator.redis_store import LoopScripts, RedisStore
from proxy.coordinator.scripts import ScriptReply

log = structlog.get_logger()

WORKER_FORGET_S = 3600.0
"""A worker silent this long disappears from ``/v1/workers``."""


class Workers:
    """The heartbeats of one run's workers."""

    def __init__(self, store: RedisStore, alive_s: float) -> None:
        self.store = store
        self.alive_s = alive_s

    async def heartbeat(self, report: HeartbeatRequest, scripts: LoopScripts) -> bool:
        """Record ``report``; True if it is the first of a new incarnation of a known worker id (restarted)."""
        return self._restarted(report, await scripts.record_heartbeat(**self._record(report)))

    def _record(self, report: HeartbeatRequest) -> dict[str, Any]:
        return {
            # Redis TIME at most once a second (RedisClock): on the event loop too, one short round trip.
            "now_ms": self.store.clock_ms(),
            "worker_id": report.worker_id,
            "report_json": report.model_dump_json(),
            "forget_after_ms": int(WORKER_FORGET_S * 1000),
            # Not the run's record TTL (days): a worker id heard from once, or made up, is gone in an hour.
            "record_ttl_s": int(WORKER_FORGET_S),
            "role": report.role,
            "incarnation": report.incarnation or "",
        }

    def _restarted(self, report: HeartbeatRequest, reply: ScriptReply) -> bool:
        restarted = reply["restarted"] == 1
        if restarted:
            log.warning(
                "proxy.worker_restarted",
                worker_id=report.worker_id,
                role=report.role,
                incarnation=report.incarnation,
                leases_ended=reply["leases_ended"],
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
