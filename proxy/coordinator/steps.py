"""Optimizer steps: claim the next one, send (and re-send) its optimize task, serve its batch, publish its version.

A step ``S`` starts from version ``S - 1`` and is claimed once enough fresh groups are buffered
(``groups_per_step * publish_every``); the init step 0 (base -1) is claimed at once in a fresh run. Groups
too stale for the base version are dropped at claim (invariant 2). One step is in flight at a time; its
optimize task is re-sent, with the same batch, when ``async.optimize_task_timeout_s`` passes without a
publish. Publishing is a CAS ``current == base_version -> version`` in Redis, done only after the version's
manifest in the bucket was checked against the request (invariant 1).
"""

from __future__ import annotations

import json
from contextlib import suppress

import structlog

from proxy.coordinator.dispatch import Dispatcher, DispatchError
from proxy.coordinator.errors import (
    ManifestMismatch,
    ManifestMissing,
    SnapshotFailed,
    StepNoLongerClaimed,
    StepNotFound,
    StepNotReady,
)
from proxy.coordinator.metrics import ProxyMetrics
from proxy.coordinator.retention import track_flag
from proxy.coordinator.snapshot import SnapshotWriter
from proxy.coordinator.store import RunStore
from proxy.protocol.schemas import OptimizeTaskMessage, PublishRequest, PublishResult, RolloutRef, StepBatch
from proxy.run.config import AsyncConfig
from proxy.storage.bucket import Bucket, ObjectNotFound
from proxy.storage.manifest import IntegrityError, read_manifest

log = structlog.get_logger()


def _refs(rollouts_json: str) -> list[RolloutRef]:
    return [RolloutRef(**ref) for ref in json.loads(rollouts_json)]


class Steps:
    """The steps of one run, from claim to publish."""

    def __init__(
        self,
        store: RunStore,
        async_config: AsyncConfig,
        bucket: Bucket,
        snapshots: SnapshotWriter,
        metrics: ProxyMetrics,
    ) -> None:
        self.store = store
        self.config = async_config
        self.bucket = bucket
        self.snapshots = snapshots
        self.metrics = metrics

    # ---- claim ----

    def claim(self) -> tuple[OptimizeTaskMessage | None, int]:
        """(the claimed step or None, groups dropped as too stale on the way)."""
        store, cfg = self.store, self.config
        now = store.clock_ms()
        try:
            reply = store.scripts.claim_step(
                now_ms=now,
                groups_needed=cfg.groups_per_step * cfg.publish_every,
                max_staleness=cfg.max_staleness,
                record_ttl_s=store.record_ttl_s,
                track=track_flag(cfg),
            )
        except StepNotReady as not_ready:
            if not_ready.dropped:
                store.mark_changed()
                log.info("proxy.stale_dropped_at_claim", groups=not_ready.dropped)
            return None, not_ready.dropped
        store.mark_changed()
        step, base = int(reply["step"]), int(reply["base_version"])
        for item in filter(None, reply["claimed"].split(",")):
            version, admitted_ms, groups = (int(part) for part in item.split(":"))
            for _ in range(groups):
                self.metrics.sample_staleness.observe(base - version)
                self.metrics.time_in_buffer.observe(max(0, now - admitted_ms) / 1000.0)
        rollouts = _refs(reply["rollouts_json"])
        dropped = int(reply["dropped"])
        log.info("proxy.step_claimed", step=step, base_version=base, rollouts=len(rollouts), dropped=dropped)
        return OptimizeTaskMessage(run=store.run, step=step, base_version=base, rollouts=rollouts), dropped

    def get(self, step: int) -> StepBatch:
        """The batch of a claimed step, as its optimize task carries it; raises StepNotFound."""
        record = self.store.redis.hgetall(self.store.keys.step(step))
        if "rollouts" not in record:
            raise StepNotFound(f"step {step} of run {self.store.run!r} was not claimed (or its record expired)")
        return StepBatch(
            step=int(record["step"]), base_version=int(record["base_version"]), rollouts=_refs(record["rollouts"])
        )

    # ---- sending ----

    def _due(self) -> tuple[OptimizeTaskMessage, bool] | None:
        """The in-flight step if it was never sent or its send timed out: (message, is_resend)."""
        store = self.store
        inflight = store.redis.hget(store.keys.state, "step_inflight")
        if inflight is None or int(inflight) < 0:
            return None
        record = store.redis.hgetall(store.keys.step(int(inflight)))
        if record.get("state") != "claimed":
            return None
        sent_ms = int(record.get("sent_ms", 0))
        timeout_ms = int(self.config.optimize_task_timeout_s * 1000)
        if sent_ms and store.clock_ms() - sent_ms <= timeout_ms:
            return None
        message = OptimizeTaskMessage(
            run=store.run,
            step=int(record["step"]),
            base_version=int(record["base_version"]),
            rollouts=_refs(record["rollouts"]),
        )
        return message, int(record.get("sends", 0)) > 0

    def send_due(self, dispatcher: Dispatcher) -> int | None:
        """Send the in-flight step's optimize task through ``dispatcher`` if it is due; returns the step sent."""
        due = self._due()
        if due is None:
            return None
        message, resend = due
        try:
            dispatcher.send_optimize(message)
        except DispatchError as error:
            log.warning("proxy.optimize_send_failed", step=message.step, error=str(error))
            return None
        # Published meanwhile: the send was harmless (the trainer's publish answers ALREADY or a conflict).
        with suppress(StepNoLongerClaimed):
            self.store.scripts.mark_step_sent(
                now_ms=self.store.clock_ms(), step=message.step, resend="1" if resend else "0"
            )
        if resend:
            log.warning("proxy.optimize_resent", step=message.step)
        return message.step

    # ---- publish ----

    def _check_manifest(self, request: PublishRequest, current: int) -> None:
        """Raise ManifestMissing/ManifestMismatch unless the bucket holds the manifest the request names."""
        store = self.store
        try:
            manifest, sha = read_manifest(self.bucket, store.run, request.version)
        except ObjectNotFound as error:
            store.count("conflicts")
            raise ManifestMissing(
                f"version {request.version} has no MANIFEST.json in the bucket; upload every file, then the "
                "manifest, then publish",
                current,
            ) from error
        except IntegrityError as error:
            store.count("conflicts")
            raise ManifestMismatch(str(error), current) from error
        if sha != request.manifest_sha256:
            store.count("conflicts")
            raise ManifestMismatch(
                f"manifest of version {request.version} in the bucket has sha256 {sha}, the request says "
                f"{request.manifest_sha256}; another trainer wrote this version",
                current,
            )
        meta = manifest.metadata
        for name in ("step", "base_version"):
            if name in meta and meta[name] != getattr(request, name):
                store.count("conflicts")
                raise ManifestMismatch(
                    f"manifest of version {request.version} names {name}={meta[name]}, the request "
                    f"{name}={getattr(request, name)}",
                    current,
                )

    def publish(self, request: PublishRequest) -> PublishResult:
        """CAS ``current == base_version -> version`` after checking the manifest in the bucket."""
        store = self.store
        self._check_manifest(request, store.current_version())
        reply = store.scripts.publish_version(
            now_ms=store.clock_ms(),
            version=request.version,
            base_version=request.base_version,
            step=request.step,
            manifest_sha256=request.manifest_sha256,
            worker_id=request.worker_id,
            record_ttl_s=store.record_ttl_s,
            track=track_flag(self.config),
        )
        change = store.changes
        if reply.code == "OK":
            change = store.mark_changed()
            log.info("proxy.version_published", version=request.version, worker=request.worker_id)
        try:
            self.snapshots.write_through(change)
        except SnapshotFailed as error:
            # The CAS is done; a rebuild adopts the version from its manifest, so this answer stays true.
            log.error("proxy.snapshot_after_publish_failed", error=str(error))
        return PublishResult(current_version=int(reply["current"]))
