"""Optimizer steps: claim the next one, serve its batch, publish its version.

A step ``S`` starts from version ``S - 1`` and is claimed once enough fresh groups are buffered
(``groups_per_step * publish_every``); the init step 0 (base -1) is claimed at once in a fresh run. Groups
too stale for the base version are dropped at claim (invariant 2). One step is in flight at a time; sending
and re-sending its optimize task is ``proxy.coordinator.step_sending``, its failure reports
``proxy.coordinator.step_failures``. Publishing is a CAS ``current == base_version -> version`` in Redis,
done only after the version's manifest in the bucket was checked against the request (invariant 1). The
publish also makes the step's record durable: before it answers OK, the manifest's ``step_record.json`` is
copied (sha-checked) to ``metrics/step-S.json`` (``proxy.coordinator.versions``).
"""

from __future__ import annotations

import json

import structlog

from asyncgrpo.bucket.backends import Bucket, ObjectNotFound
from asyncgrpo.bucket.manifest import IntegrityError, Manifest, read_manifest
from asyncgrpo.protocol.schemas import OptimizeTaskMessage, PublishRequest, PublishResult, RolloutRef, StepBatch
from asyncgrpo.run.config import AsyncConfig
from proxy.coordinator.errors import (
    ManifestMismatch,
    ManifestMissing,
    SnapshotFailed,
    StepNotFound,
    StepNotReady,
)
from proxy.coordinator.metrics import ProxyMetrics
from proxy.coordinator.redis_store import RedisStore
from proxy.coordinator.retention import track_flag
from proxy.coordinator.snapshot import SnapshotWriter
from proxy.coordinator.versions import Versions

log = structlog.get_logger()


def _refs(rollouts_json: str) -> list[RolloutRef]:
    return [RolloutRef(**ref) for ref in json.loads(rollouts_json)]


class Steps:
    """The steps of one run, from claim to publish."""

    def __init__(
        self,
        store: RedisStore,
        async_config: AsyncConfig,
        bucket: Bucket,
        snapshots: SnapshotWriter,
        metrics: ProxyMetrics,
        versions: Versions,
        final_version: int,
    ) -> None:
        self.versions = versions
        self.final_version = final_version  # no step is claimed from it: the run ends there
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
                final_version=self.final_version,
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

    # ---- publish ----

    def _check_manifest(self, request: PublishRequest, current: int) -> Manifest:
        """The manifest the request names; raises ManifestMissing/ManifestMismatch unless the bucket holds it."""
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
        # An upload made from the step's batch before it was un-claimed (a rollout rejected, the attempts
        # used up) and claimed again with another batch must not publish: its groups are back in the buffer
        # or rejected, and would count as trained.
        claimed = store.redis.hget(store.keys.step(request.step), "rollouts")
        if "rollouts" in meta and claimed is not None:
            batch = sorted(ref.task_id for ref in _refs(claimed))
            if sorted(meta["rollouts"]) != batch:
                store.count("conflicts")
                raise ManifestMismatch(
                    f"manifest of version {request.version} was made from rollouts {sorted(meta['rollouts'])}, "
                    f"but step {request.step} is now claimed with {batch}; it was claimed again meanwhile",
                    current,
                )
        return manifest

    def publish(self, request: PublishRequest) -> PublishResult:
        """CAS ``current == base_version -> version`` after checking the manifest in the bucket."""
        store = self.store
        manifest = self._check_manifest(request, store.current_version())
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
        # Before answering: the record is part of what the publish makes durable. A failure here is an error
        # answer; the worker's retry (ALREADY) or the next tick copies it again.
        self.versions.copy_step_record(request.version, manifest)
        try:
            self.snapshots.write_through(change)
        except SnapshotFailed as error:
            # The CAS is done; a rebuild adopts the version from its manifest, so this answer stays true.
            log.error("proxy.snapshot_after_publish_failed", error=str(error))
        return PublishResult(current_version=int(reply["current"]))
