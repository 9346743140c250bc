"""One optimize task as a plain function: one published version from one claimed batch.

Steps: make sure the trainer holds version ``base_version`` (memory when it matches, else the bucket),
fetch the claimed rollouts (sha256 checked), check staleness again, check each rollout's ratio under the
version it claims (the check that flags a generator serving the wrong weights: fresh samples reuse the first
update's training forward, a seeded sample of the others is rescored, see ``worker.optimize.rescore``), take
``publish_every`` optimizer updates, upload version ``step`` (files first, manifest last), publish it by
compare-and-set, and write the step record (``worker.optimize.step_record``) to ``metrics/step-S.json`` from
memory, with its upload and publish times.

Idempotent: a redelivered step that is already published is a no-op; one whose upload finished but whose
publish did not (the worker died in between) publishes the uploaded version instead of training again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import structlog

from proxy.protocol.client import ProxyClient
from proxy.protocol.errors import Conflict
from proxy.protocol.records import StepRecord, StepTimings
from proxy.protocol.schemas import PublishRequest, RolloutRef
from proxy.protocol.staleness import check_fresh
from proxy.run.config import RunConfig
from proxy.storage import bucket_keys
from proxy.storage.bucket import Bucket, ObjectNotFound
from proxy.storage.manifest import IntegrityError, delete_version, read_manifest, read_verified, write_version
from worker.algo.rollout import Rollout, decode_rollout
from worker.optimize.batch import build_train_samples, split_indices_by_group
from worker.optimize.rescore import (
    flag_drifting_rollouts,
    forget_adapter_weights,
    plan_rescoring,
    ratios_by_rollout,
    remember_adapter_weights,
    rescore_planned,
)
from worker.optimize.step_record import build_step_record
from worker.optimize.trainer import Trainer

log = structlog.get_logger()

STEP_RECORD_NAME = "step_record.json"


@dataclass
class OptimizeResult:
    """What one optimize task did; the task logs and returns its ``summary()`` and feeds it to the metrics."""

    step: int
    status: str  # published | already_published | republished | conflict
    version: int
    record: StepRecord | None = None  # when this task (or an earlier attempt of it) trained the step

    def summary(self) -> dict[str, Any]:
        """The task's JSON result (and its log line's fields)."""
        brief: dict[str, Any] = {}
        if self.record is not None:
            record = self.record
            brief = {
                "samples": record.samples,
                "reward_mean": record.reward_mean,
                "ratio": record.ratio,
                "max_staleness": record.max_staleness,
                "step_s": record.timings.step_s,
            }
        return {"step": self.step, "status": self.status, "version": self.version, **brief}


def load_trainer_version(trainer: Trainer, bucket: Bucket, run: str, version: int) -> None:
    """Load version ``version`` (weights, optimizer moments, step, RNG) from the bucket, verified."""
    manifest, _ = read_manifest(bucket, run, version)
    files = {
        name: read_verified(bucket, bucket_keys.adapter_file_key(run, version, name), entry.sha256)
        for name, entry in manifest.files.items()
        if name != STEP_RECORD_NAME
    }
    loaded = trainer.load_version_files(files)
    if loaded != version:
        raise IntegrityError(f"trainer state under {bucket_keys.adapter_prefix(run, version)} says version {loaded}")


def _uploaded_attempt(bucket: Bucket, run: str, step: int, base_version: int) -> str | None:
    """sha256 of a complete earlier upload of this step from the same base, if one exists."""
    try:
        manifest, manifest_sha = read_manifest(bucket, run, step)
    except ObjectNotFound:
        return None
    if manifest.metadata.get("base_version") != base_version:
        return None
    try:
        for name, entry in manifest.files.items():
            read_verified(bucket, bucket_keys.adapter_file_key(run, step, name), entry.sha256)
    except (IntegrityError, ObjectNotFound) as error:
        # A torn earlier attempt (never published): remove it so this attempt can write a clean one.
        log.warning("optimize.broken_upload_discarded", step=step, error=str(error))
        delete_version(bucket, run, step)
        return None
    return manifest_sha


def _copy_step_record(bucket: Bucket, run: str, step: int) -> StepRecord | None:
    manifest, _ = read_manifest(bucket, run, step)
    entry = manifest.files.get(STEP_RECORD_NAME)
    if entry is None:
        return None
    data = read_verified(bucket, bucket_keys.adapter_file_key(run, step, STEP_RECORD_NAME), entry.sha256)
    bucket.put(bucket_keys.metrics_key(run, step), data)
    return StepRecord.model_validate_json(data)


def run_initialize(
    *, run: str, trainer: Trainer, bucket: Bucket, client: ProxyClient, worker_id: str
) -> OptimizeResult:
    """Version 0: the seeded LoRA init, published by CAS from -1."""
    if client.run_info().current_version >= 0:
        return OptimizeResult(step=0, status="already_published", version=0)
    manifest_sha = _uploaded_attempt(bucket, run, 0, -1)
    if manifest_sha is None:
        _, manifest_sha = write_version(
            bucket, run, 0, trainer.version_files(0), {"step": 0, "base_version": -1, "worker_id": worker_id}
        )
    try:
        client.publish(
            PublishRequest(version=0, base_version=-1, step=0, worker_id=worker_id, manifest_sha256=manifest_sha)
        )
    except Conflict as error:
        log.warning("optimize.init_publish_lost", error=str(error))
        return OptimizeResult(step=0, status="conflict", version=0)
    trainer.version = 0
    return OptimizeResult(step=0, status="published", version=0)


def run_optimize_step(
    *,
    run: str,
    step: int,
    base_version: int,
    rollout_refs: list[RolloutRef],
    config: RunConfig,
    trainer: Trainer,
    bucket: Bucket,
    client: ProxyClient,
    worker_id: str,
) -> OptimizeResult:
    started = time.perf_counter()
    if step != base_version + 1:
        raise ValueError(f"optimize step {step} must start from version {step - 1}, not {base_version}")
    current = client.run_info().current_version
    if current >= step:
        log.info("optimize.step_already_published", step=step, current=current)
        _ensure_step_record(bucket, run, step)
        return OptimizeResult(step=step, status="already_published", version=current)

    manifest_sha = _uploaded_attempt(bucket, run, step, base_version)
    record: StepRecord | None = None  # set when this attempt trained the step
    status = "republished"
    if manifest_sha is None:
        status = "published"
        try:
            record, manifest_sha = _train_and_upload(
                run, step, base_version, rollout_refs, config, trainer, bucket, worker_id, started
            )
        except BaseException:
            # Updates may have been applied in memory; the bucket's base_version is the truth again.
            trainer.version = None
            raise
    publish_started = time.perf_counter()
    try:
        client.publish(
            PublishRequest(
                version=step, base_version=base_version, step=step, worker_id=worker_id, manifest_sha256=manifest_sha
            )
        )
    except Conflict as error:
        if not _published_is_ours(bucket, run, step, manifest_sha, client):
            # Someone else published this version (we were a zombie or a redelivery): drop our work.
            log.warning("optimize.publish_lost", step=step, error=str(error))
            trainer.version = None  # force a reload from the bucket next time
            forget_adapter_weights(run, step)
            _ensure_step_record(bucket, run, step)
            return OptimizeResult(step=step, status="conflict", version=step)
        # Our upload is the published version: a rebuilt proxy adopted it from the bucket, or our first
        # publish went through and only its answer was lost.
        log.info("optimize.upload_already_published", step=step)
    if record is None:
        # Republished an earlier attempt's upload: its record is only in the bucket.
        return OptimizeResult(step=step, status=status, version=step, record=_copy_step_record(bucket, run, step))
    # The published manifest is ours, so its record is the one in memory: write metrics/ from it (no
    # re-read), with the upload and publish times the stored copy could not hold.
    record.timings.publish_s = time.perf_counter() - publish_started
    bucket.put(bucket_keys.metrics_key(run, step), _record_bytes(record))
    return OptimizeResult(step=step, status=status, version=step, record=record)


def _record_bytes(record: StepRecord) -> bytes:
    return json.dumps(record.model_dump(mode="json"), sort_keys=True).encode()


def _published_is_ours(bucket: Bucket, run: str, step: int, manifest_sha: str, client: ProxyClient) -> bool:
    if client.run_info().current_version < step:
        return False
    try:
        _, published_sha = read_manifest(bucket, run, step)
    except ObjectNotFound:
        return False
    return published_sha == manifest_sha


def _ensure_step_record(bucket: Bucket, run: str, step: int) -> None:
    """Copy a published version's step record to metrics/ if an earlier attempt died before doing so.

    Manifests are create-only, so the version folder's record is the published version's, whoever made it.
    """
    if bucket.head(bucket_keys.metrics_key(run, step)) is not None:
        return
    try:
        _copy_step_record(bucket, run, step)
    except ObjectNotFound:
        log.warning("optimize.step_record_lost", step=step)


def _fetch_rollouts(bucket: Bucket, refs: list[RolloutRef]) -> list[Rollout]:
    rollouts = []
    for ref in refs:
        data = read_verified(bucket, ref.key, ref.sha256)
        rollout = decode_rollout(data)
        if rollout.version != ref.version or rollout.task_id != ref.task_id:
            raise IntegrityError(
                f"rollout {ref.key} says version {rollout.version}/task {rollout.task_id}, but the claim names "
                f"version {ref.version}/task {ref.task_id}"
            )
        rollouts.append(rollout)
    return rollouts


def _train_and_upload(
    run: str,
    step: int,
    base_version: int,
    refs: list[RolloutRef],
    config: RunConfig,
    trainer: Trainer,
    bucket: Bucket,
    worker_id: str,
    started: float,
) -> tuple[StepRecord, str]:
    if trainer.version != base_version:
        load_started = time.perf_counter()
        load_trainer_version(trainer, bucket, run, base_version)
        load_s = time.perf_counter() - load_started
        log.info("optimize.trainer_state_loaded", version=base_version, seconds=load_s)

    fetch_started = time.perf_counter()
    rollouts = _fetch_rollouts(bucket, refs)
    fetch_s = time.perf_counter() - fetch_started
    max_staleness = config.async_.max_staleness
    for rollout in rollouts:
        # Invariant 2, checked again where the gradient is made: the proxy should never send these.
        check_fresh(base_version, rollout.version, max_staleness)

    samples, sample_keys = build_train_samples(rollouts)
    sample_rollout = [owner for owner, _ in sample_keys]
    chunks = split_indices_by_group(sample_keys, config.async_.publish_every)
    plan = plan_rescoring(
        trainer, rollouts, sample_rollout, base_version=base_version, first_update=chunks[0],
        fraction=config.loss.rescore_stale_fraction, seed=config.seed * 2**32 + step,
    )
    rescore_started = time.perf_counter()
    # Before any update: the separately rescored samples need the weights of the versions they claim.
    ratio_sums = rescore_planned(trainer, bucket, run, base_version, rollouts, samples, plan)
    rescore_s = time.perf_counter() - rescore_started

    updates = []
    for number, chunk in enumerate(chunks):
        metrics, sums = trainer.step_with_ratio_sums([samples[i] for i in chunk])
        updates.append(metrics)
        if number == 0:  # the first update's forward ran under base_version: the fresh samples' rescoring
            reused = set(plan.reused)
            ratio_sums.update((index, value) for index, value in zip(chunk, sums, strict=True) if index in reused)
    trainer.version = None  # dirty until the new version's files are written
    rollout_ratios = ratios_by_rollout(samples, ratio_sums, sample_rollout, len(rollouts))
    flagged = flag_drifting_rollouts(rollouts, rollout_ratios, config.loss.ratio_flag_tolerance)

    serialize_started = time.perf_counter()
    files = trainer.version_files(step)
    serialize_s = time.perf_counter() - serialize_started
    record = build_step_record(
        run=run,
        step=step,
        base_version=base_version,
        worker_id=worker_id,
        rollouts=rollouts,
        ratios=rollout_ratios.mean,
        flagged=flagged,
        updates=updates,
        timings=StepTimings(
            fetch_s=fetch_s, rescore_s=rescore_s, serialize_s=serialize_s, step_s=time.perf_counter() - started
        ),
    )
    record.rescored_sequences = plan.rescored
    record.reused_sequences = len(plan.reused)
    files[STEP_RECORD_NAME] = _record_bytes(record)
    publish_started = time.perf_counter()
    metadata = {
        "step": step,
        "base_version": base_version,
        "worker_id": worker_id,
        "rollouts": [r.task_id for r in rollouts],
    }
    _, manifest_sha = write_version(bucket, run, step, files, metadata)
    # The in-memory LoRA is exactly the uploaded version: keep a copy for rescoring its rollouts next step.
    remember_adapter_weights(run, step, [parameter.detach().clone() for parameter in trainer.lora_parameters])
    record.timings.upload_s = time.perf_counter() - publish_started
    return record, manifest_sha
