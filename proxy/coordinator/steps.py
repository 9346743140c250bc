"""Steps and versions: claim a step, serve its batch, send it to a trainer, take its failure reports, publish
its version, and look after published versions. The classes follow a step's life.

``Steps`` -- a step ``S`` starts from version ``S - 1`` and is claimed once enough fresh groups are buffered
(``groups_per_step * publish_every``); the init step 0 (base -1) is claimed at once in a fresh run. Groups too
stale for the base version are dropped at claim (invariant 2). One step is in flight at a time. Publishing is
a CAS ``current == base_version -> version`` in Redis, done only after the version's manifest in the bucket
was checked against the request (invariant 1). The publish also makes the step's record durable: before it
answers OK, the manifest's ``step_record.json`` is copied (sha-checked) to ``metrics/step-S.json``.

``StepSending`` -- where the step in flight goes and when it is sent again (invariant 8). Where: the own queue
(``asyncgrpo.protocol.schemas.worker_queue``) of a live optimize worker that holds version ``S - 1`` in memory
-- the one that published it, else one whose heartbeat reports ``info.trainer_version == S - 1`` -- so no
trainer reloads state from the bucket; else the run's shared queue. Workers that failed this step are passed
over while another one is alive. When: at once when claimed; at once again when a failure report asks for it;
at once when its holder (the worker that started it) is not heard from within ``worker_alive_s`` or is heard
from in a new incarnation (restarted under its id), or when the worker whose own queue it went to dies or
restarts before starting it; and after ``async.optimize_task_timeout_s`` in any case. A restarted worker has
lost what it held in memory, so it is no longer trusted to hold the version it published. A dead holder's
late publish is harmless: publishing is a CAS. Every message carries a Celery ``expires`` of the re-send
timeout, so an old copy the broker redelivers is dropped unrun; a copy that does run finds its step published
or its batch changed (``start`` refuses it) and ends at once.

``StepFailures`` -- the step's holder and its failure reports: poison steps end (invariant 9), an unloadable
base halts the run. ``start``: the worker that starts step ``S`` becomes its holder. ``report``
(``POST /v1/steps/{S}/failure``), by kind:

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

``Versions`` -- published versions after the CAS:

- ``info``: the manifest sha256 the proxy recorded at publish (``GET /v1/versions/{version}``); readers
  compare the bucket's manifest against it, never against whatever the bucket holds now.
- ``copy_step_record``: the published manifest's ``step_record.json`` (sha-checked) copied to
  ``metrics/step-S.json``, as part of the publish; the round repairs the newest version's record if a proxy
  died between the CAS and the copy.
- ``report_corrupt``: a worker found an object of a published version failing its sha256. The proxy reads it
  again itself; if it is corrupt it sends a repair task to the own queue of the alive optimize worker that
  holds the version's bytes (its publisher, or a trainer whose heartbeat says it holds the version). With no
  such worker the run halts naming the key, and the round reads the object again every ``RECHECK_S``,
  resuming once it reads back intact (an operator restored it).
"""

from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import dataclass

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectNotFound
from asyncgrpo.bucket.layout import IntegrityError, Manifest, read_manifest, read_verified
from asyncgrpo.protocol.schemas import (
    CorruptReport,
    CorruptResult,
    OptimizeTaskMessage,
    PublishRequest,
    PublishResult,
    RepairTaskMessage,
    RolloutRef,
    StepBatch,
    StepFailureReport,
    StepFailureResult,
    StepStartRequest,
    StepStartResult,
    VersionInfo,
    worker_queue,
)
from asyncgrpo.run.config import AsyncConfig
from proxy.coordinator.dispatch import Dispatcher, DispatchError
from proxy.coordinator.leases import track_flag
from proxy.coordinator.metrics import ProxyMetrics
from proxy.coordinator.redis_store import RedisStore, clear_halt, halt, halted_reason
from proxy.coordinator.rollouts import normalise_reason
from proxy.coordinator.scripts import (
    BadStepFailure,
    ManifestMismatch,
    ManifestMissing,
    SnapshotFailed,
    StepNoLongerClaimed,
    StepNotFound,
    StepNotReady,
    VersionNotFound,
)
from proxy.coordinator.snapshot import SnapshotWriter

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
            rejected, requeued = reply["groups_rejected"], reply["groups_requeued"]
            log.warning(
                "proxy.step_unclaimed",
                **fields,
                task_id=report.task_id,
                groups_rejected=rejected,
                groups_requeued=requeued,
                detail=report.detail,
            )
            return StepFailureResult(outcome="unclaimed", groups_rejected=rejected, groups_requeued=requeued)
        attempts = reply["attempts"]
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

    def send_due(self, dispatcher: Dispatcher) -> int | None:
        """Housekeeping's part here: lift this module's halt if its cause is gone, then send or re-send the step
        in flight if it is due (``StepSending.send_due``: claimed, dead holder, timeout); the step sent, or
        None."""
        self.review_halt()
        return self.sending.send_due(dispatcher)

    def review_halt(self) -> None:
        """Lift this module's halt once a live worker holds the base or has not tried to load it (tick)."""
        store = self.store
        if store.redis.hget(store.keys.state, "halted_by") != BASE_HALT or halted_reason(store) is None:
            return
        inflight = int(store.redis.hget(store.keys.state, "step_inflight") or -1)
        record = store.redis.hgetall(store.keys.step(inflight)) if inflight >= 0 else {}
        if record.get("state") != "claimed" or not self.base_blocked(inflight - 1, record.get("base_failed", "")):
            clear_halt(store, by=BASE_HALT)


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


CORRUPT_HALT = "corrupt_version"
"""The halt source (``proxy.coordinator.steps``) of a corrupted object no live worker can put back."""

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
        self.store.write_logged_field("state", HALT_CHECK_FIELD, check)
        halt(
            self.store,
            f"object {report.key!r} of published version {version} is corrupted (expected sha256 {expected}) and "
            "no alive optimize worker holds its bytes; restore it (e.g. from a backup) and the run resumes",
            by=CORRUPT_HALT,
        )
        self._last_recheck_ms = now
        return CorruptResult(action="halted")

    def tick(self) -> None:
        """Housekeeping's part here: copy a published version's step record that a crash left uncopied, and read
        a corrupted object again (one an operator restored lifts its halt)."""
        self.repair_missing_record()
        self.recheck_halt()

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
        self.store.write_logged_field("state", HALT_CHECK_FIELD, None)
        clear_halt(self.store, by=CORRUPT_HALT)
        log.warning("proxy.corrupt_object_restored", version=check["version"], key=check["key"])
        return None


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
        step, base = reply["step"], reply["base_version"]
        for version, admitted_ms, groups in reply["claimed"]:
            for _ in range(groups):
                self.metrics.sample_staleness.observe(base - version)
                self.metrics.time_in_buffer.observe(max(0, now - admitted_ms) / 1000.0)
        rollouts = [RolloutRef(**ref) for ref in reply["rollouts_json"]]
        dropped = reply["dropped"]
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
        return PublishResult(current_version=reply["current"])
