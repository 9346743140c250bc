"""A step's holder and its failure reports: poison steps end (invariant 9), an unloadable base halts the run.

``start``: the optimize worker that starts step ``S`` becomes its holder (``proxy.coordinator.step_sending``
re-sends the step when the holder's heartbeats stop); a copy whose batch is no longer the step's is refused.

``report`` (``POST /v1/steps/{S}/failure``), by kind:

- ``rollout``: the named rollout is unusable (missing, failing its sha256, malformed, non-finite). It is
  rejected with the reason (its groups counted in ``groups_rejected`` and the rejected-reasons hash) and the
  step is un-claimed: the rest of the batch goes back to the front of the buffer, the step record is dropped,
  and the next tick claims the step again with a new batch.
- ``step``: no rollout named (a non-finite gradient norm, a bug). Counts an attempt and is re-sent at once,
  to another live worker if there is one; at ``async.max_step_attempts`` the whole batch is rejected and the
  step un-claimed the same way.
- ``base``: the worker could not load the base version ``S - 1`` (its files fail their check). The step is
  re-sent at once to a live worker holding that version in memory, else to one that has not failed to load
  it; when every live optimize worker has failed and none holds it, the run halts (``redis_store.halt``) with
  the key to repair, and resumes by itself when a worker that has not tried comes up.
- ``upload``: the version's create-only manifest exists, made from another batch (an attempt from before the
  step was claimed again). It can never publish; the proxy removes it (``Versions.remove_foreign_upload``:
  only unpublished, only another batch) and re-sends the step at once, counting nothing.
"""

from __future__ import annotations

import json

import structlog

from asyncgrpo.bucket import keys as bucket_keys
from asyncgrpo.protocol.schemas import StepFailureReport, StepFailureResult, StepStartRequest, StepStartResult
from asyncgrpo.run.config import AsyncConfig
from proxy.coordinator.errors import BadStepFailure
from proxy.coordinator.redis_store import RedisStore, clear_halt, halt, halted_reason
from proxy.coordinator.retention import track_flag
from proxy.coordinator.rollouts import normalise_reason
from proxy.coordinator.step_sending import StepSending
from proxy.coordinator.versions import Versions

log = structlog.get_logger()

BASE_HALT = "base_unloadable"
"""The ``by`` of the halt this module sets and clears."""


class StepFailures:
    """Holders and failure reports of one run's steps."""

    def __init__(self, store: RedisStore, async_config: AsyncConfig, sending: StepSending, versions: Versions) -> None:
        self.store = store
        self.config = async_config
        self.sending = sending
        self.versions = versions

    def start(self, step: int, request: StepStartRequest) -> StepStartResult:
        """Record ``request.worker_id`` as the step's holder; raises StepNoLongerClaimed for an old copy."""
        self.store.scripts.start_step(
            now_ms=self.store.clock_ms(),
            step=step,
            worker_id=request.worker_id,
            base_version=request.base_version,
            task_ids_json=json.dumps(request.task_ids),
            incarnation=request.incarnation or "",
        )
        log.info("proxy.step_started", step=step, worker=request.worker_id)
        return StepStartResult(step=step)

    def report(self, step: int, report: StepFailureReport) -> StepFailureResult:
        """Apply a failure report; raises BadStepFailure for one that cannot match the step (nothing changed)."""
        store = self.store
        if report.kind == "base" and step == 0:
            # Step 0 makes version 0 from the base model: there is no adapter version it could fail to load.
            raise BadStepFailure(
                "step 0 initialises version 0 and has no base version to load; report kind 'step' for a failed "
                "initialisation"
            )
        reason = normalise_reason(report.reason)
        if report.kind == "upload":
            self.versions.remove_foreign_upload(step)
        reply = store.scripts.fail_step(
            now_ms=store.clock_ms(),
            step=step,
            worker_id=report.worker_id,
            kind=report.kind,
            reason=reason,
            task_id=report.task_id or "",
            max_attempts=self.config.max_step_attempts,
            record_ttl_s=store.record_ttl_s,
            track=track_flag(self.config),
        )
        fields = {"step": step, "worker": report.worker_id, "kind": report.kind, "reason": reason}
        if reply.code == "NOT_CLAIMED":
            log.info("proxy.step_failure_ignored", **fields)
            return StepFailureResult(outcome="not_claimed")
        store.mark_changed()
        if reply.code == "OK":
            rejected, requeued = int(reply["groups_rejected"]), int(reply["groups_requeued"])
            log.warning(
                "proxy.step_unclaimed",
                **fields,
                task_id=report.task_id,
                groups_rejected=rejected,
                groups_requeued=requeued,
                detail=report.detail,
            )
            return StepFailureResult(outcome="unclaimed", groups_rejected=rejected, groups_requeued=requeued)
        attempts = int(reply["attempts"])
        log.warning("proxy.step_failed", **fields, attempts=attempts, detail=report.detail)
        if report.kind == "base" and self.base_blocked(step - 1, reply["base_failed"]):
            halt(
                store,
                f"no live optimize worker can load version {step - 1} (base of step {step}): {report.detail or reason}"
                f"; repair or delete {bucket_keys.adapter_prefix(store.run, step - 1)} or start a trainer that "
                "holds it",
                by=BASE_HALT,
            )
            return StepFailureResult(outcome="halted", attempts=attempts)
        return StepFailureResult(outcome="retry", attempts=attempts)

    def base_blocked(self, base_version: int, base_failed: str) -> bool:
        """No live worker holds ``base_version`` and every live optimize worker failed to load it."""
        alive = self.sending.alive_optimize_workers()
        failed = {w for w in base_failed.split(",") if w}
        return not self.sending.holders_of(base_version, alive) and set(alive) <= failed

    def review_halt(self) -> None:
        """Lift this module's halt once a live worker holds the base or has not tried to load it (tick)."""
        store = self.store
        if store.redis.hget(store.keys.state, "halted_by") != BASE_HALT or halted_reason(store) is None:
            return
        inflight = int(store.redis.hget(store.keys.state, "step_inflight") or -1)
        record = store.redis.hgetall(store.keys.step(inflight)) if inflight >= 0 else {}
        if record.get("state") != "claimed" or not self.base_blocked(inflight - 1, record.get("base_failed", "")):
            clear_halt(store, by=BASE_HALT)
