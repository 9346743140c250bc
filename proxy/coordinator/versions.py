"""Published versions after the CAS: their recorded manifest sha, their step records, their repair.

- ``info``: the manifest sha256 the proxy recorded at publish (``GET /v1/versions/{version}``); readers
  compare the bucket's manifest against it, never against whatever the bucket holds now.
- ``copy_step_record``: the published manifest's ``step_record.json`` (sha-checked) copied to
  ``metrics/step-S.json``, as part of the publish; ``tick`` repairs the newest version's record if a proxy
  died between the CAS and the copy.
- ``report_corrupt``: a worker found an object of a published version failing its sha256. The proxy reads it
  again itself; if it is corrupt it sends a repair task to the own queue of the alive optimize worker that
  holds the version's bytes (its publisher, or a trainer whose heartbeat says it holds the version). With no
  such worker the run halts (``proxy.coordinator.step_failures``) naming the key, and ``tick`` reads the object again
  every ``RECHECK_S``, resuming once it reads back intact (an operator restored it).
"""

from __future__ import annotations

import json

import structlog

from asyncgrpo.bucket import keys as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectNotFound
from asyncgrpo.bucket.manifest import IntegrityError, Manifest, read_manifest, read_verified
from asyncgrpo.protocol.schemas import CorruptReport, CorruptResult, RepairTaskMessage, VersionInfo
from proxy.coordinator.dispatch import Dispatcher, DispatchError
from proxy.coordinator.errors import VersionNotFound
from proxy.coordinator.redis_store import RedisStore, clear_halt, halt, halted_reason
from proxy.coordinator.step_sending import StepSending

log = structlog.get_logger()

CORRUPT_HALT = "corrupt_version"
"""The halt source (``proxy.coordinator.step_failures``) of a corrupted object no live worker can put back."""

RECHECK_S = 30.0
"""How often a halted run reads its corrupted object again."""
REPAIR_RESEND_S = 30.0
"""A repair of one object is sent at most this often, however many workers report it."""
HALT_CHECK_FIELD = "halt_check"
"""State-hash field: the object a halt waits on, as JSON {version, key, sha256}."""


class Versions:
    """The published versions of one run: recorded shas, step records, corruption reports."""

    def __init__(self, store: RedisStore, bucket: Bucket, sending: StepSending) -> None:
        self.store = store
        self.bucket = bucket
        self.sending = sending  # who holds a version: its publisher, else a live trainer by heartbeat
        self._record_checked = -1  # newest version whose metrics record was seen (this process)
        self._last_recheck_ms = 0
        self._repairs_sent: dict[str, int] = {}  # key -> when its last repair was sent (ms)

    def recorded_sha(self, version: int) -> str | None:
        return self.store.redis.hget(self.store.keys.versions, str(version))

    def info(self, version: int) -> VersionInfo:
        sha = self.recorded_sha(version)
        if sha is None:
            raise VersionNotFound(f"version {version} of run {self.store.run!r} was never published (or collected)")
        return VersionInfo(version=version, manifest_sha256=sha)

    # ---- step records ----

    def copy_step_record(self, version: int, manifest: Manifest | None = None) -> bool:
        """Copy the published manifest's step record to ``metrics/``; False if the version has none.

        ``manifest``: the one the publish just checked against its request, whose sha the CAS recorded (not
        read again); else it is read and checked against the sha the proxy recorded."""
        run = self.store.run
        if manifest is None:
            sha = self.recorded_sha(version)
            if sha is None:
                return False
            manifest, manifest_sha = read_manifest(self.bucket, run, version)
            if manifest_sha != sha:
                raise IntegrityError(
                    f"manifest of version {version} has sha256 {manifest_sha}, the proxy published {sha}",
                    key=bucket_keys.manifest_key(run, version),
                    expected=sha,
                    actual=manifest_sha,
                )
        entry = manifest.files.get(bucket_keys.STEP_RECORD_NAME)
        if entry is None:
            return False  # version 0, the seeded init, trained nothing
        data = read_verified(self.bucket, manifest.file_key(run, bucket_keys.STEP_RECORD_NAME), entry.sha256)
        self.bucket.put(bucket_keys.metrics_key(run, version), data)
        return True

    def remove_foreign_upload(self, step: int) -> bool:
        """Delete step ``step``'s manifest if it is unpublished and made from another batch than the claimed one.

        Such a manifest comes from an attempt (a trainer thought dead) that uploaded after the step was
        un-claimed and claimed again with another batch. Publish refuses it (``Steps._check_manifest``), and
        being create-only it would block every attempt with the new batch forever. A published version (the
        proxy recorded its sha) is never touched. The attempt's files stay until retention collects the version.
        """
        store = self.store
        if store.current_version() >= step or self.recorded_sha(step) is not None:
            return False
        claimed = store.redis.hget(store.keys.step(step), "rollouts")
        try:
            manifest, _ = read_manifest(self.bucket, store.run, step)
        except (ObjectNotFound, IntegrityError):
            return False
        if claimed is None:
            return False
        batch = sorted(ref["task_id"] for ref in json.loads(claimed))
        if sorted(manifest.metadata.get("rollouts", [])) == batch:
            return False  # this very batch: republishing it is the way on, not removing it
        self.bucket.delete(bucket_keys.manifest_key(store.run, step))
        log.warning("proxy.foreign_upload_removed", step=step, made_from=manifest.metadata.get("rollouts"))
        return True

    def repair_missing_record(self) -> None:
        """The newest published version gets its metrics record if a publish died before copying it."""
        current = self.store.current_version()
        if current < 1 or current == self._record_checked:
            return
        try:
            if self.bucket.head(bucket_keys.metrics_key(self.store.run, current)) is None:
                self.copy_step_record(current)
                log.warning("proxy.step_record_repaired", version=current)
            self._record_checked = current
        except (IntegrityError, ObjectNotFound, OSError) as error:
            log.warning("proxy.step_record_repair_failed", version=current, error=str(error))

    # ---- corruption ----

    def _check_object(self, version: int, key: str) -> tuple[str, str] | None:
        """``(action, sha256 it must have)`` for ``key``: 'intact', 'corrupt' or 'not_in_manifest'."""
        run = self.store.run
        recorded = self.info(version).manifest_sha256
        manifest_key = bucket_keys.manifest_key(run, version)
        try:
            manifest, manifest_sha = read_manifest(self.bucket, run, version)
        except (IntegrityError, ObjectNotFound):
            manifest, manifest_sha = None, ""
        if key == manifest_key or manifest is None or manifest_sha != recorded:
            return ("intact" if manifest_sha == recorded else "corrupt"), recorded
        name = manifest.name_of_key(run, key)
        if name is None:
            return "not_in_manifest", ""
        expected = manifest.files[name].sha256
        try:
            read_verified(self.bucket, key, expected)
        except (IntegrityError, ObjectNotFound):
            return "corrupt", expected
        return "intact", expected

    def _holder(self, version: int) -> str | None:
        """The alive optimize worker that holds ``version``'s bytes: its publisher first, else by heartbeat."""
        holders = self.sending.holders_of(version, self.sending.alive_optimize_workers())
        return holders[0] if holders else None

    def report_corrupt(self, version: int, report: CorruptReport, dispatcher: Dispatcher) -> CorruptResult:
        action, expected = self._check_object(version, report.key)
        log.warning("proxy.corrupt_reported", version=version, key=report.key, worker=report.worker_id, found=action)
        if action != "corrupt":
            return CorruptResult(action=action)  # type: ignore[arg-type]
        holder = self._holder(version)
        now = self.store.clock_ms()
        if holder is not None:
            last = self._repairs_sent.get(report.key)
            if last is None or now - last >= REPAIR_RESEND_S * 1000:
                sha = self.info(version).manifest_sha256
                message = RepairTaskMessage(run=self.store.run, version=version, key=report.key, manifest_sha256=sha)
                try:
                    dispatcher.send_repair(message, holder)
                    self._repairs_sent[report.key] = now
                    log.warning("proxy.repair_sent", version=version, key=report.key, holder=holder)
                except DispatchError as error:
                    log.warning("proxy.repair_send_failed", version=version, error=str(error))
            return CorruptResult(action="repair_sent", holder=holder)
        check = json.dumps({"version": version, "key": report.key})
        self.store.redis.hset(self.store.keys.state, HALT_CHECK_FIELD, check)
        halt(
            self.store,
            f"object {report.key!r} of published version {version} is corrupted (expected sha256 {expected}) and "
            "no alive optimize worker holds its bytes; restore it (e.g. from a backup) and the run resumes",
            by=CORRUPT_HALT,
        )
        self._last_recheck_ms = now
        return CorruptResult(action="halted")

    def recheck_halt(self) -> str | None:
        """While halted for a corrupted object, read it again every ``RECHECK_S``; the halt reason, or None."""
        reason = halted_reason(self.store)
        raw = self.store.redis.hget(self.store.keys.state, HALT_CHECK_FIELD)
        if reason is None or raw is None:
            return reason
        now = self.store.clock_ms()
        if now - self._last_recheck_ms < RECHECK_S * 1000:
            return reason
        self._last_recheck_ms = now
        check = json.loads(raw)
        try:
            action, _ = self._check_object(int(check["version"]), check["key"])
        except (VersionNotFound, OSError) as error:
            log.warning("proxy.halt_recheck_failed", error=str(error))
            return reason
        if action == "corrupt":
            return reason
        self.store.redis.hdel(self.store.keys.state, HALT_CHECK_FIELD)
        clear_halt(self.store, by=CORRUPT_HALT)
        log.warning("proxy.corrupt_object_restored", version=check["version"], key=check["key"])
        return None
