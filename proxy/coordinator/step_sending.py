"""Sending the in-flight step: where it goes, and when it is sent again (invariant 8).

Where: step ``S`` goes to the own queue (``asyncgrpo.protocol.queues.worker_queue``) of a live optimize worker that
holds version ``S - 1`` in memory -- the one that published it, else one whose heartbeat reports
``info.trainer_version == S - 1`` -- so no trainer reloads state from the bucket; else to the run's shared queue.
Workers that failed this step (a non-finite step, a base they could not load) are passed over while another
one is alive.

When: at once when claimed; at once again when a failure report asks for it (``proxy.coordinator.
step_failures``); at once when its holder (the worker that started it, ``POST /v1/steps/{S}/start``) is not
heard from within ``worker_alive_s`` or is heard from in a new incarnation (restarted under its id, see
``proxy.coordinator.status``), or when the worker whose own queue it went to dies or restarts before starting
it; and after ``async.optimize_task_timeout_s`` in any case. A restarted worker has lost what it held in memory,
so it is no longer trusted to hold the version it published. A dead holder's late publish is harmless: publishing
is a CAS. Every message carries a Celery ``expires`` of the re-send timeout, so an old copy the broker
redelivers after its visibility timeout is dropped unrun; a copy that does run finds its step published or
its batch changed (``start_step`` refuses it) and ends at once.
"""

from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import dataclass

import structlog

from asyncgrpo.protocol.queues import worker_queue
from asyncgrpo.protocol.schemas import OptimizeTaskMessage, RolloutRef
from asyncgrpo.run.config import AsyncConfig
from proxy.coordinator.dispatch import Dispatcher, DispatchError
from proxy.coordinator.errors import StepNoLongerClaimed
from proxy.coordinator.redis_store import RedisStore, halted_reason

log = structlog.get_logger()


@dataclass(frozen=True)
class DueStep:
    """The in-flight step, due to be sent, and why: ``claimed`` (first send), ``requested`` (after a failure
    report), ``holder_dead``, ``holder_restarted``, ``target_dead``, ``target_restarted`` or ``timeout``."""

    message: OptimizeTaskMessage
    reason: str
    record: dict[str, str]

    @property
    def resend(self) -> bool:
        return self.reason != "claimed"


def failed_workers(record: dict[str, str]) -> set[str]:
    """Workers that failed this step: could not load its base, or the last one whose attempt failed."""
    failed = {w for w in record.get("base_failed", "").split(",") if w}
    if record.get("last_failed"):
        failed.add(record["last_failed"])
    return failed


class StepSending:
    """Routes and (re-)sends the in-flight step of one run."""

    def __init__(self, store: RedisStore, async_config: AsyncConfig, alive_s: float) -> None:
        self.store = store
        self.config = async_config
        self.alive_s = alive_s

    # ---- who is alive, who holds what ----

    def last_seen_ms(self, worker_id: str) -> int | None:
        seen = self.store.redis.zscore(self.store.keys.workers_optimize, worker_id)
        return None if seen is None else int(seen)

    def silent(self, worker_id: str, since_ms: int) -> bool:
        """No heartbeat within ``alive_s``, counted from ``since_ms`` at the earliest (its start or send)."""
        seen = max(self.last_seen_ms(worker_id) or 0, since_ms)
        return self.store.clock_ms() - seen > self.alive_s * 1000

    def alive_optimize_workers(self) -> dict[str, dict]:
        """Live optimize workers and the ``info`` of their last heartbeat."""
        store = self.store
        since = store.clock_ms() - int(self.alive_s * 1000)
        ids = store.redis.zrangebyscore(store.keys.workers_optimize, since, "+inf")
        out: dict[str, dict] = {}
        for worker_id in ids:
            report = store.redis.hget(store.keys.worker(worker_id), "report")
            out[worker_id] = json.loads(report).get("info", {}) if report else {}
        return out

    def restarted_since(self, worker_id: str, since_ms: int) -> bool:
        """A new incarnation of ``worker_id`` was heard after ``since_ms``: the process of then is gone."""
        restarts, incarnation_ms = self.store.redis.hmget(
            self.store.keys.worker(worker_id), ["restarts", "incarnation_ms"]
        )
        return int(restarts or 0) > 0 and int(incarnation_ms or 0) > since_ms

    def restarted(self, worker_id: str, incarnation: str | None) -> bool:
        """``worker_id`` was heard from in another incarnation than ``incarnation`` (None or "": unknown)."""
        if not incarnation:
            return False
        latest = self.store.redis.hget(self.store.keys.worker(worker_id), "incarnation")
        return latest is not None and latest != incarnation

    def publisher_of(self, version: int) -> str | None:
        """The worker that published ``version`` and still runs in the process that did (its step record keeps
        it until the record's TTL)."""
        if version < 0:
            return None
        worker_id, published_ms = self.store.redis.hmget(self.store.keys.step(version), ["worker_id", "published_ms"])
        if worker_id is None or self.restarted_since(worker_id, int(published_ms or 0)):
            return None
        return worker_id

    def holders_of(self, version: int, alive: dict[str, dict]) -> list[str]:
        """Live workers holding ``version`` in memory, best first: its publisher, then by heartbeat."""
        holders = [w for w, info in sorted(alive.items()) if info.get("trainer_version") == version]
        publisher = self.publisher_of(version)
        if publisher in alive:
            # Trusted over its heartbeat, which may predate the publish by up to one interval.
            holders = [publisher, *[w for w in holders if w != publisher]]
        return holders

    def route(self, base_version: int, avoid: set[str]) -> str | None:
        """The worker whose own queue step ``base_version + 1`` goes to, or None for the shared queue."""
        alive = self.alive_optimize_workers()
        for holder in self.holders_of(base_version, alive):
            if holder not in avoid:
                return holder
        if avoid & set(alive):
            # A worker failed this step: send it to another live one, not back to the shared queue it reads.
            others = sorted(set(alive) - avoid)
            if others:
                return others[0]
        return None

    # ---- sending ----

    def due(self) -> DueStep | None:
        """The in-flight step if it must be sent now, with the reason."""
        store = self.store
        inflight = store.redis.hget(store.keys.state, "step_inflight")
        if inflight is None or int(inflight) < 0:
            return None
        record = store.redis.hgetall(store.keys.step(int(inflight)))
        if record.get("state") != "claimed":
            return None
        now = store.clock_ms()
        sent_ms = int(record.get("sent_ms", 0))
        if not sent_ms:
            reason = "requested" if int(record.get("sends", 0)) else "claimed"
        elif now - sent_ms > self.config.optimize_task_timeout_s * 1000:
            reason = "timeout"
        elif record.get("holder"):
            if self.restarted(record["holder"], record.get("holder_incarnation")):
                reason = "holder_restarted"
            elif self.silent(record["holder"], int(record.get("started_ms", sent_ms))):
                reason = "holder_dead"
            else:
                return None
        elif record.get("target") and self.restarted_since(record["target"], sent_ms):
            # Its old process may have taken the message (unacked until the broker's visibility timeout).
            reason = "target_restarted"
        elif record.get("target") and self.silent(record["target"], sent_ms):
            reason = "target_dead"
        else:
            return None
        message = OptimizeTaskMessage(
            run=store.run,
            step=int(record["step"]),
            base_version=int(record["base_version"]),
            rollouts=[RolloutRef(**ref) for ref in json.loads(record["rollouts"])],
        )
        return DueStep(message, reason, record)

    def send_due(self, dispatcher: Dispatcher) -> int | None:
        """Send the in-flight step through ``dispatcher`` if it is due (not while halted); the step sent."""
        due = self.due()
        if due is None or halted_reason(self.store) is not None:
            return None
        message = due.message
        avoid = failed_workers(due.record)
        if due.reason in ("holder_dead", "holder_restarted"):
            avoid.add(due.record["holder"])
        if due.reason == "target_restarted":
            avoid.add(due.record["target"])
        target = self.route(message.base_version, avoid)
        queue = worker_queue(message.run, target) if target else None
        try:
            dispatcher.send_optimize(message, queue=queue, expires_s=self.config.optimize_task_timeout_s)
        except DispatchError as error:
            log.warning("proxy.optimize_send_failed", step=message.step, error=str(error))
            return None
        # Published meanwhile: the send was harmless (the trainer's publish answers ALREADY or a conflict).
        with suppress(StepNoLongerClaimed):
            self.store.scripts.mark_step_sent(
                now_ms=self.store.clock_ms(),
                step=message.step,
                resend="1" if due.resend else "0",
                target=target or "",
            )
        if due.resend:
            log.warning(
                "proxy.optimize_resent",
                step=message.step,
                reason=due.reason,
                target=target,
                holder=due.record.get("holder"),
            )
        else:
            log.info("proxy.optimize_sent", step=message.step, target=target)
        return message.step
