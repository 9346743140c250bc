"""One optimize step as an object: one published version from one claimed batch, its step record, and why a
step could not be trained when it could not.

``Optimizer`` holds what a worker's trainer keeps for its run (config, trainer, bucket, client, the held
version, the recent versions' weights for rescoring) and runs one task per call, its phases as its methods in
order. A step's phases: make sure the trainer holds version ``base_version`` (memory when it matches, else the bucket),
fetch the claimed rollouts (sha256 checked), check staleness again, check each rollout's ratio under the
version it claims (the check that flags a generator serving the wrong weights: fresh samples reuse the first
update's training forward, a seeded sample of the others is rescored, see ``worker.optimize.rescore``), take
``publish_every`` optimizer updates, upload version ``step`` (files under this attempt's own folder, then
the create-only manifest naming them, with the step record ``worker.optimize.job`` among the files)
and publish it by compare-and-set; the proxy copies the record to ``metrics/step-S.json`` as it publishes.

Idempotent: a redelivered step that is already published is a no-op; one whose upload finished but whose
publish did not (the worker died in between) publishes the uploaded version instead of training again. An
attempt whose manifest write or CAS another attempt won ends with status ``conflict`` (an info line, not an
error); which manifest won is judged by the sha the proxy recorded, never by the bucket alone. The bytes of
the last version uploaded or loaded stay in memory (``HeldVersion``) to repair the bucket.

Before any work the task tells the proxy it holds the step (``POST /v1/steps/{S}/start``), so the step is
re-sent at once if this worker dies; a copy whose batch is no longer the step's ends there. A step it cannot
train raises a ``worker.optimize.job.StepFailure`` naming why (an unusable rollout, an unloadable base)
for the task to report.

Why an optimize task could not train its step, as the proxy's failure report names it (invariant 9).

The job raises one of these (or the trainer's ``NonFiniteError``); the Celery task reports it with
``POST /v1/steps/{S}/failure`` and ends acknowledged, so the proxy -- not a retry loop -- decides what
happens next: a named rollout is rejected and the step claimed again without it, a step failure counts an
attempt, an unloadable base goes to another trainer or halts the run.

The step record of one optimize step: what it trained on and how the policy moved.

``build_step_record`` turns the step's rollouts, their rescoring ratios and the trainer's per-update metrics
into a ``asyncgrpo.protocol.records.StepRecord``; the optimize job stores it with the new version and copies it
to ``runs/<run>/metrics/``. Pure: no I/O, no torch. Its token counts and completion lengths are the model's
tokens: an agent completion's tool answers count in neither.

Versions in the bucket (below): as the job reads them, pinned to the sha the proxy recorded.

Loading a base version into the trainer, finding an earlier attempt's complete upload of the same step (never
deleted: a version with a manifest is immutable), the record stored with a version, and whether the proxy
published our manifest. A corrupted object of a published version is reported to the proxy, which repairs it
from the memory of the trainer holding it or halts the run.

The exact bytes of the last version this trainer uploaded (or loaded), kept to repair the bucket (``HeldVersion``).

A published version's object that the bucket corrupted is put back from here: the proxy sends a repair task
to the own queue of the worker holding the version, and ``HeldVersion.repair`` re-puts the object under the same
key only if these bytes' sha256 equal the manifest's entry (versions stay immutable: same content, same
key). One version is held per trainer, replaced by the next upload or load.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectExists, ObjectNotFound
from asyncgrpo.bucket.layout import (
    IntegrityError,
    Manifest,
    read_manifest,
    read_verified,
    read_version_files,
    sha256_hex,
    write_version,
)
from asyncgrpo.protocol.client import ProxyClient, process_incarnation
from asyncgrpo.protocol.errors import Conflict, NotFound, StepGone
from asyncgrpo.protocol.records import (
    CorrectionFigures,
    FlaggedRollout,
    RolloutEntry,
    StepRecord,
    StepTimings,
    ToolFigures,
    UpdateMetrics,
)
from asyncgrpo.protocol.schemas import (
    OptimizeTaskMessage,
    PublishRequest,
    RepairTaskMessage,
    RolloutRef,
    StepFailureKind,
    StepFailureReport,
    StepStartRequest,
    check_fresh,
    staleness,
)
from asyncgrpo.run.config import RunConfig
from worker.algo.grpo import NonFiniteError
from worker.algo.rollout import Rollout, decode_rollout, newest_token_version, oldest_token_version
from worker.corrupt_report import report_corrupt
from worker.optimize.batch import TrainSample, build_train_samples, split_indices_by_group
from worker.optimize.rescore import (
    RecentAdapterWeights,
    RescorePlan,
    flag_drifting_rollouts,
    plan_rescoring,
    ratios_by_rollout,
    rescore_planned,
)
from worker.optimize.trainer import RatioSums, Trainer


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _std(values: list[float]) -> float | None:
    """Population std (all completions of the step are the population)."""
    mean = _mean(values)
    return math.sqrt(sum((x - mean) ** 2 for x in values) / len(values)) if mean is not None else None


@dataclass
class _TokenStalenesses:
    """Model tokens trained on, by staleness."""

    counts: dict[int, int]

    def mean(self) -> float | None:
        tokens = sum(self.counts.values())
        return sum(value * count for value, count in self.counts.items()) / tokens if tokens else None

    def max(self) -> int | None:
        return max(self.counts, default=None)


def _token_stalenesses(base_version: int, rollouts: list[Rollout], oldest_trained: int | None) -> _TokenStalenesses:
    """Each model token's staleness: base_version minus the version that sampled it; a token older than
    ``oldest_trained`` was masked out, so it is not counted."""
    counts: dict[int, int] = {}
    for rollout in rollouts:
        for sample in rollout.samples:
            flags = sample.completion_mask or [True] * len(sample.completion_token_ids)
            versions = sample.token_versions or [rollout.version] * len(flags)
            for version, model in zip(versions, flags, strict=True):
                if model and (oldest_trained is None or version >= oldest_trained):
                    value = staleness(base_version, version)
                    counts[value] = counts.get(value, 0) + 1
    return _TokenStalenesses(counts)


def build_step_record(
    *,
    run: str,
    step: int,
    base_version: int,
    worker_id: str,
    rollouts: list[Rollout],
    ratios: list[float | None],
    flagged: list[FlaggedRollout],
    updates: list[UpdateMetrics],
    timings: StepTimings,
    oldest_trained: int | None = None,
) -> StepRecord:
    """The record of step ``step`` (from ``base_version``); ``ratios`` are the rollouts' rescoring ratios;
    ``oldest_trained``: tokens of older versions were masked out (``async.stale_tokens = "mask"``)."""
    samples = [sample for rollout in rollouts for sample in rollout.samples]
    rewards = [sample.reward for sample in samples]
    stalenesses = [staleness(base_version, rollout.version) for rollout in rollouts]
    token_stalenesses = _token_stalenesses(base_version, rollouts, oldest_trained)
    reward_names = sorted({name for sample in samples for name in sample.rewards_by_name})
    by_name = {name: [sample.rewards_by_name.get(name, 0.0) for sample in samples] for name in reward_names}
    # The model's tokens: an agent completion's tool answers are not its length, nor tokens trained on.
    completion_lengths = [sample.model_tokens for sample in samples]
    truncated = sum(1 for sample in samples if sample.finish_reason == "length")
    return StepRecord(
        run=run,
        step=step,
        version=step,
        base_version=base_version,
        worker_id=worker_id,
        published_at=time.time(),
        samples=len(samples),
        groups=sum(len(rollout.groups) for rollout in rollouts),
        tokens=sum(completion_lengths),
        reward_mean=_mean(rewards),
        reward_std=_std(rewards),
        rewards_by_name={name: _mean(values) for name, values in by_name.items()},
        rewards_std_by_name={name: _std(values) for name, values in by_name.items()},
        completion_length_mean=_mean([float(length) for length in completion_lengths]),
        truncated_fraction=truncated / len(samples) if samples else 0.0,
        staleness=stalenesses,
        max_staleness=max(stalenesses, default=0),
        token_staleness_mean=token_stalenesses.mean(),
        token_staleness_max=token_stalenesses.max(),
        ratio=_mean([update.ratio for update in updates]),
        rescore_ratio=_mean([ratio for ratio in ratios if ratio is not None]),
        kl=_mean([update.kl for update in updates]),
        entropy=_mean([update.entropy for update in updates]),
        clip_low=_mean([update.clip_low for update in updates]),
        clip_high=_mean([update.clip_high for update in updates]),
        clip_region=_mean([update.clip_region for update in updates]),
        loss=_mean([update.loss for update in updates]),
        grad_norm=_mean([update.grad_norm for update in updates]),
        lr=_mean([update.lr for update in updates]),
        updates=updates,
        rollouts=[
            RolloutEntry(
                task_id=rollout.task_id,
                version=rollout.version,
                worker_id=rollout.worker_id,
                ratio=ratio,
                group_ids=[group.group_id for group in rollout.groups],
                prompt_indices=[group.prompt_index for group in rollout.groups],
                samples=len(rollout.samples),
            )
            for rollout, ratio in zip(rollouts, ratios, strict=True)
        ],
        flagged_rollouts=flagged,
        timings=timings,
        tools=ToolFigures.of([rollout.extra.agent for rollout in rollouts if rollout.extra.agent is not None]),
    )


class StepFailure(Exception):
    """The step cannot be trained by this attempt; ``kind``/``reason``/``task_id`` as the report carries them."""

    kind: StepFailureKind = "step"

    def __init__(self, reason: str, detail: str, task_id: str | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.task_id = task_id

    def report(self, worker_id: str) -> StepFailureReport:
        return StepFailureReport(
            worker_id=worker_id, kind=self.kind, reason=self.reason, detail=self.detail[:4000], task_id=self.task_id
        )


class RolloutUnusable(StepFailure):
    """A claimed rollout the trainer cannot use: missing, failing its sha256, malformed or non-finite."""

    kind: StepFailureKind = "rollout"

    def __init__(self, task_id: str, reason: str, detail: str) -> None:
        super().__init__(reason, f"rollout {task_id}: {detail}", task_id)


class BaseUnloadable(StepFailure):
    """The step's base version cannot be loaded from the bucket (its files fail their check, or are gone)."""

    kind: StepFailureKind = "base"


class ForeignUpload(StepFailure):
    """The step's version already has a manifest made from another batch, not yet published: an attempt from
    before the step was claimed again. The proxy removes it and re-sends the step."""

    kind: StepFailureKind = "upload"


def step_failure_of(error: BaseException) -> StepFailure | None:
    """The failure to report for ``error``, or None if it is not a step failure (a bug, a transient error)."""
    if isinstance(error, StepFailure):
        return error
    if isinstance(error, NonFiniteError):
        # Deterministic for a given batch and base: counted as an attempt, the batch rejected at the limit.
        return StepFailure("non_finite_gradient", str(error))
    return None


def _finite(values: list[float]) -> bool:
    return all(math.isfinite(value) for value in values)


def validate_rollout(rollout: Rollout) -> None:
    """Raise RolloutUnusable unless every sample is well formed and finite (before any training)."""
    groups = len(rollout.groups)
    for index, sample in enumerate(rollout.samples):
        where = f"sample {index}"
        if not sample.prompt_token_ids or len(sample.completion_token_ids) != len(sample.behavior_logprobs):
            raise RolloutUnusable(
                rollout.task_id,
                "rollout_malformed",
                f"{where} has {len(sample.prompt_token_ids)} prompt tokens, {len(sample.completion_token_ids)} "
                f"completion tokens and {len(sample.behavior_logprobs)} behaviour logprobs",
            )
        if not 0 <= sample.group_index < groups:
            raise RolloutUnusable(
                rollout.task_id, "rollout_malformed", f"{where} names group {sample.group_index} of {groups}"
            )
        if sample.completion_mask is not None and len(sample.completion_mask) != len(sample.completion_token_ids):
            raise RolloutUnusable(
                rollout.task_id,
                "rollout_malformed",
                f"{where} has {len(sample.completion_token_ids)} completion tokens but a mask of "
                f"{len(sample.completion_mask)}",
            )
        if not _finite(sample.behavior_logprobs):
            raise RolloutUnusable(rollout.task_id, "rollout_non_finite", f"{where} has non-finite logprobs")
        if not _finite([sample.advantage, sample.reward]):
            raise RolloutUnusable(
                rollout.task_id,
                "rollout_non_finite",
                f"{where} has advantage {sample.advantage} and reward {sample.reward}",
            )


log = structlog.get_logger()

STEP_RECORD_NAME = bucket_keys.STEP_RECORD_NAME


@dataclass
class OptimizeResult:
    """What one optimize task did; the task logs and returns its ``summary()`` and feeds it to the metrics."""

    step: int
    status: str  # published | already_published | republished | conflict | not_claimed
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


class Optimizer:
    """One optimize worker's trainer for one run, and what it keeps between steps: the version it holds for
    repairs (``held``) and the recent versions' LoRA weights for rescoring (``recent``).

    Built once per run by the worker's runtime (``worker.process.runtime``); each optimize task is one call of
    ``run_task``. A step's phases are its methods below, in the order a step goes through them.
    """

    def __init__(
        self,
        run: str,
        config: RunConfig,
        trainer: Trainer,
        bucket: Bucket,
        client: ProxyClient,
        worker_id: str,
        *,
        between_files: Callable[[], None] | None = None,
    ) -> None:
        self.run = run
        self.config = config
        self.trainer = trainer
        self.bucket = bucket
        self.client = client
        self.worker_id = worker_id
        self.between_files = between_files  # the test hook ASYNCGRPO_UPLOAD_PAUSE_S
        self.held = HeldVersion()
        self.recent = RecentAdapterWeights()

    def run_task(self, message: OptimizeTaskMessage) -> OptimizeResult:
        """The optimize task ``message``: version 0 from nothing, or one step from its base version."""
        if message.step == 0:
            return self.initialize()
        return self.step(message.step, message.base_version, message.rollouts)

    def initialize(self) -> OptimizeResult:
        """Version 0: the seeded LoRA init, published by CAS from -1."""
        run, trainer, bucket, client, worker_id = self.run, self.trainer, self.bucket, self.client, self.worker_id
        if client.run_info().current_version >= 0:
            return OptimizeResult(step=0, status="already_published", version=0)
        if not self._start(0, -1, []):
            return OptimizeResult(step=0, status="not_claimed", version=-1)
        files = trainer.version_files(0)
        try:
            manifest, manifest_sha = write_version(
                bucket, run, 0, files, {"step": 0, "base_version": -1, "worker_id": worker_id}
            )
        except ObjectExists as error:
            # An earlier attempt's init won the manifest (and may have died before publishing): publish it.
            log.info("optimize.upload_lost", step=0, error=str(error))
            manifest, manifest_sha = read_manifest(bucket, run, 0)
        try:
            client.publish(
                PublishRequest(version=0, base_version=-1, step=0, worker_id=worker_id, manifest_sha256=manifest_sha)
            )
        except Conflict as error:
            if not published_is_ours(0, manifest_sha, client):
                log.info("optimize.publish_lost", step=0, error=str(error))
                return OptimizeResult(step=0, status="conflict", version=0)
        if same_bytes(manifest, files):
            self.held.hold(run, manifest, manifest_sha, files)
        trainer.version = 0
        return OptimizeResult(step=0, status="published", version=0)

    def step(self, step: int, base_version: int, rollout_refs: list[RolloutRef]) -> OptimizeResult:
        """Step ``step`` from ``base_version`` over the claimed ``rollout_refs``: trained, uploaded and published
        (or an earlier attempt's upload published, or nothing to do)."""
        started = time.perf_counter()
        if step != base_version + 1:
            raise ValueError(f"optimize step {step} must start from version {step - 1}, not {base_version}")
        current = self.client.run_info().current_version
        if current >= step:
            log.info("optimize.step_already_published", step=step, current=current)
            return OptimizeResult(step=step, status="already_published", version=current)
        batch = [ref.task_id for ref in rollout_refs]
        if not self._start(step, base_version, batch):
            return OptimizeResult(step=step, status="not_claimed", version=current)

        record: StepRecord | None = None  # set when this attempt trained the step
        status = "republished"
        try:
            manifest_sha = self.uploaded_attempt(step, batch)
            if manifest_sha is None:
                status = "published"
                try:
                    record, manifest_sha = self._train_and_upload(step, base_version, rollout_refs, started)
                except ObjectExists as error:
                    # Another attempt of this step won the create-only manifest while we trained. Publish its
                    # upload (it may have died before publishing) unless it was made from another batch.
                    log.info("optimize.upload_lost", step=step, error=str(error))
                    self._drop(step)
                    status, manifest_sha = "republished", self.uploaded_attempt(step, batch)
                except BaseException:
                    # Updates may have been applied in memory; the bucket's base_version is the truth again.
                    self.trainer.version = None
                    raise
        except UploadConflict as error:
            self.recent.forget(self.run, step)
            if self.client.run_info().current_version >= step:
                log.info("optimize.upload_lost", step=step, error=str(error))
                return OptimizeResult(step=step, status="conflict", version=step)
            # Unpublished and from another batch: it can never publish and blocks this one; the proxy removes it.
            raise ForeignUpload("foreign_upload", str(error)) from error
        publish_started = time.perf_counter()
        if not self._publish(step, base_version, manifest_sha):
            return OptimizeResult(step=step, status="conflict", version=step)
        if record is None:
            # Republished an earlier attempt's upload: its record is only in the bucket.
            record = stored_step_record(self.bucket, self.run, step)
            return OptimizeResult(step=step, status=status, version=step, record=record)
        # The proxy copied the version's record to metrics/ before answering; the in-memory one adds the upload
        # and publish times for this worker's metrics.
        record.timings.publish_s = time.perf_counter() - publish_started
        return OptimizeResult(step=step, status=status, version=step, record=record)

    def repair(self, message: RepairTaskMessage) -> str:
        """Put a corrupted object of the held version back (``HeldVersion.repair``)."""
        return self.held.repair(self.bucket, message)

    # ---- the phases of a step, in order ----

    def _start(self, step: int, base_version: int, task_ids: list[str]) -> bool:
        """Become the step's holder; False for a copy the proxy no longer wants (published, or claimed again)."""
        request = StepStartRequest(
            worker_id=self.worker_id, base_version=base_version, task_ids=task_ids, incarnation=process_incarnation()
        )
        try:
            self.client.start_step(step, request)
        except StepGone as error:
            log.info("optimize.step_not_claimed", step=step, error=str(error))
            return False
        return True

    def _train_and_upload(
        self, step: int, base_version: int, refs: list[RolloutRef], started: float
    ) -> tuple[StepRecord, str]:
        """Every phase of a step this attempt trains, from its base version to its uploaded files."""
        config = self.config
        self._load_base(base_version)

        fetch_started = time.perf_counter()
        rollouts = _fetch_rollouts(self.bucket, refs)
        fetch_s = time.perf_counter() - fetch_started
        max_staleness = config.async_.max_staleness
        masking = config.async_.stale_tokens == "mask"
        for rollout in rollouts:
            # Invariant 2, per token, checked again where the gradient is made: the proxy should never send these.
            # Masking, only the newest token must be in the window: the older ones are masked out below.
            checked = newest_token_version(rollout) if masking else oldest_token_version(rollout)
            check_fresh(base_version, checked, max_staleness)
        oldest_trained = base_version - max_staleness if masking else None

        samples, sample_keys = build_train_samples(rollouts, config.loss, oldest_trained)
        sample_rollout = [owner for owner, _ in sample_keys]
        chunks = split_indices_by_group(sample_keys, config.async_.publish_every)
        plan = plan_rescoring(
            self.trainer,
            rollouts,
            sample_rollout,
            base_version=base_version,
            first_update=chunks[0],
            fraction=config.loss.rescore_stale_fraction,
            seed=config.seed * 2**32 + step,
            samples=samples,
        )
        rescore_started = time.perf_counter()
        ratio_sums = self._rescore(base_version, rollouts, samples, plan)
        rescore_s = time.perf_counter() - rescore_started

        updates = self._update(samples, chunks, plan, ratio_sums)
        rollout_ratios = ratios_by_rollout(samples, ratio_sums, sample_rollout, len(rollouts))
        flagged = flag_drifting_rollouts(rollouts, rollout_ratios, config.loss.ratio_flag_tolerance)

        serialize_started = time.perf_counter()
        files = self.trainer.version_files(step)
        serialize_s = time.perf_counter() - serialize_started
        record = build_step_record(
            run=self.run,
            step=step,
            base_version=base_version,
            worker_id=self.worker_id,
            rollouts=rollouts,
            ratios=rollout_ratios.mean,
            flagged=flagged,
            updates=updates,
            oldest_trained=oldest_trained,
            timings=StepTimings(
                fetch_s=fetch_s, rescore_s=rescore_s, serialize_s=serialize_s, step_s=time.perf_counter() - started
            ),
        )
        if masking:
            record.masked_stale_tokens = sum(sample.masked_stale for sample in samples)
        record.rescored_sequences = plan.rescored
        record.reused_sequences = len(plan.reused)
        record.importance_sampling_ratio = CorrectionFigures.combine(
            [update.importance_sampling_ratio for update in updates if update.importance_sampling_ratio is not None]
        )
        files[bucket_keys.STEP_RECORD_NAME] = _record_bytes(record)
        upload_started = time.perf_counter()
        manifest_sha = self._upload(step, base_version, rollouts, files)
        record.timings.upload_s = time.perf_counter() - upload_started
        return record, manifest_sha

    def _load_base(self, base_version: int) -> None:
        """The trainer at ``base_version``: memory when it matches, else the bucket; a failure to load it is
        this step's ``BaseUnloadable`` (reported, not retried)."""
        if self.trainer.version == base_version:
            return
        load_started = time.perf_counter()
        try:
            self.load_version(base_version)
        except (IntegrityError, ObjectNotFound, NotFound) as error:
            raise BaseUnloadable("base_unloadable", f"version {base_version}: {error}") from error
        log.info("optimize.trainer_state_loaded", version=base_version, seconds=time.perf_counter() - load_started)

    def _rescore(
        self, base_version: int, rollouts: list[Rollout], samples: list[TrainSample], plan: RescorePlan
    ) -> dict[int, RatioSums]:
        """The plan's separate rescoring, before any update: those samples need the weights of the versions
        they claim."""
        return rescore_planned(
            self.trainer,
            self.bucket,
            self.run,
            base_version,
            rollouts,
            samples,
            plan,
            recorded_sha=lambda version: self.client.version_info(version).manifest_sha256,
            recent=self.recent,
        )

    def _update(
        self, samples: list[TrainSample], chunks: list[list[int]], plan: RescorePlan, ratio_sums: dict[int, RatioSums]
    ) -> list[UpdateMetrics]:
        """``publish_every`` optimizer updates; the first one's forward also rescores the fresh samples."""
        updates = []
        for number, chunk in enumerate(chunks):
            metrics, sums = self.trainer.step_with_ratio_sums([samples[i] for i in chunk])
            updates.append(metrics)
            if number == 0:  # the first update's forward ran under base_version: the fresh samples' rescoring
                reused = set(plan.reused)
                ratio_sums.update((index, value) for index, value in zip(chunk, sums, strict=True) if index in reused)
        self.trainer.version = None  # dirty until the new version's files are written
        return updates

    def _upload(self, step: int, base_version: int, rollouts: list[Rollout], files: dict[str, bytes]) -> str:
        """Write version ``step`` (its files, then the create-only manifest); the manifest's sha."""
        metadata = {
            "step": step,
            "base_version": base_version,
            "worker_id": self.worker_id,
            "rollouts": [r.task_id for r in rollouts],
        }
        manifest, manifest_sha = write_version(
            self.bucket, self.run, step, files, metadata, between_files=self.between_files
        )
        if same_bytes(manifest, files):  # a redelivery may get an earlier attempt's manifest back
            self.held.hold(self.run, manifest, manifest_sha, files)
        # The in-memory LoRA is exactly the uploaded version: keep a copy for rescoring its rollouts next step.
        self.recent.remember(self.run, step, [parameter.detach().clone() for parameter in self.trainer.lora_parameters])
        return manifest_sha

    def _publish(self, step: int, base_version: int, manifest_sha: str) -> bool:
        """Ask the proxy to publish our manifest as version ``step`` (CAS); False if another attempt's won."""
        request = PublishRequest(
            version=step, base_version=base_version, step=step, worker_id=self.worker_id, manifest_sha256=manifest_sha
        )
        try:
            self.client.publish(request)
        except Conflict as error:
            if not published_is_ours(step, manifest_sha, self.client):
                # Someone else published this version (we were a zombie or a redelivery): drop our work.
                log.info("optimize.publish_lost", step=step, error=str(error))
                self._drop(step)  # force a reload from the bucket next time
                return False
            # Our upload is the published version: a rebuilt proxy adopted it from the bucket, or our first
            # publish went through and only its answer was lost.
            log.info("optimize.upload_already_published", step=step)
        return True

    def _drop(self, step: int) -> None:
        """Our version ``step`` lost to another attempt's: the trainer and its kept weights are not it."""
        self.trainer.version = None
        self.recent.forget(self.run, step)

    # ---- the step's versions in the bucket ----

    def load_version(self, version: int) -> None:
        """Load version ``version`` (weights, optimizer moments, step, RNG) from the bucket, verified against the
        manifest sha the proxy recorded at publish; a corrupted object is reported to the proxy, then raised."""
        run = self.run
        expected = self.client.version_info(version).manifest_sha256
        try:
            manifest, manifest_sha, files = read_version_files(
                self.bucket, run, version, expected, skip=(bucket_keys.STEP_RECORD_NAME,)
            )
        except IntegrityError as error:
            report_corrupt(self.client, version, self.worker_id, error, role="optimize")
            raise
        loaded = self.trainer.load_version_files(files)
        if loaded != version:
            key = bucket_keys.manifest_key(run, version)
            raise IntegrityError(f"trainer state of version {version} ({key}) says version {loaded}", key=key)
        self.held.hold(run, manifest, manifest_sha, files)

    def uploaded_attempt(self, step: int, rollout_ids: list[str]) -> str | None:
        """sha256 of a complete earlier upload of this very step (same base, same batch), if one exists.

        Never deletes it: a manifest is create-only and a version with one is immutable. One made from another
        batch is a conflict (``UploadConflict``), never adopted.
        """
        run, bucket = self.run, self.bucket
        try:
            manifest, manifest_sha = read_manifest(bucket, run, step)
        except ObjectNotFound:
            return None
        meta = manifest.metadata
        if meta.get("base_version") != step - 1 or sorted(meta.get("rollouts", [])) != sorted(rollout_ids):
            key = bucket_keys.manifest_key(run, step)
            raise UploadConflict(f"version {step} was uploaded from another batch ({key})")
        try:
            for name, entry in manifest.files.items():
                read_verified(bucket, manifest.file_key(run, name), entry.sha256)
        except IntegrityError as error:
            if self.client.run_info().current_version >= step:
                report_corrupt(self.client, step, self.worker_id, error, role="optimize")
            raise
        return manifest_sha


def _record_bytes(record: StepRecord) -> bytes:
    return json.dumps(record.model_dump(mode="json"), sort_keys=True).encode()


def _fetch_rollouts(bucket: Bucket, refs: list[RolloutRef]) -> list[Rollout]:
    """The claimed rollouts, each verified and validated; RolloutUnusable names the first that is not."""
    rollouts = []
    for ref in refs:
        try:
            data = read_verified(bucket, ref.key, ref.sha256)
        except ObjectNotFound as error:
            raise RolloutUnusable(ref.task_id, "rollout_missing", str(error)) from error
        except IntegrityError as error:
            raise RolloutUnusable(ref.task_id, "rollout_integrity", str(error)) from error
        try:
            rollout = decode_rollout(data)
        except Exception as error:  # any decoding failure of verified bytes is the rollout's, not ours
            raise RolloutUnusable(ref.task_id, "rollout_malformed", f"{type(error).__name__}: {error}") from error
        if rollout.version != ref.version or rollout.task_id != ref.task_id:
            raise RolloutUnusable(
                ref.task_id,
                "rollout_mismatch",
                f"{ref.key} says version {rollout.version}/task {rollout.task_id}, but the claim names "
                f"version {ref.version}/task {ref.task_id}",
            )
        validate_rollout(rollout)
        rollouts.append(rollout)
    return rollouts


# ---- the version held to repair the bucket ----


@dataclass(frozen=True)
class HeldFiles:
    run: str
    manifest: Manifest
    manifest_sha256: str
    files: dict[str, bytes]


class HeldVersion:
    """The exact bytes of the last version this trainer uploaded (or loaded), kept to repair the bucket; one
    version at a time, replaced by the next upload or load (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: HeldFiles | None = None

    @property
    def version(self) -> int | None:
        with self._lock:
            return None if self._held is None else self._held.manifest.version

    def hold(self, run: str, manifest: Manifest, manifest_sha256: str, files: dict[str, bytes]) -> None:
        """Keep ``files`` (the bytes just uploaded or verified) as the held copy of ``manifest.version``."""
        with self._lock:
            self._held = HeldFiles(run, manifest, manifest_sha256, dict(files))

    def repair(self, bucket: Bucket, message: RepairTaskMessage) -> str:
        """Put ``message.key`` back from the held bytes; returns what happened (a bounded word for the log)."""
        with self._lock:
            held = self._held
        if held is None or held.run != message.run or held.manifest.version != message.version:
            return "not_held"
        if held.manifest_sha256 != message.manifest_sha256:
            return "other_manifest"  # we hold a losing attempt's bytes: never put them under the published keys
        if message.key == bucket_keys.manifest_key(message.run, message.version):
            data = held.manifest.to_bytes()
            expected = message.manifest_sha256
        else:
            name = held.manifest.name_of_key(message.run, message.key)
            if name is None or name not in held.files:
                return "not_held"
            data, expected = held.files[name], held.manifest.files[name].sha256
        if sha256_hex(data) != expected:
            return "bytes_differ"
        bucket.put(message.key, data)
        read_verified(bucket, message.key, expected)  # it reads back intact, or the task fails loudly
        return "repaired"


# ---- a step's versions in the bucket ----


class UploadConflict(Exception):
    """Another attempt's manifest for this version exists and is not ours to publish."""


def stored_step_record(bucket: Bucket, run: str, step: int) -> StepRecord | None:
    """The record in a version's files (an earlier attempt's upload); the task's result reports it."""
    manifest, _ = read_manifest(bucket, run, step)
    entry = manifest.files.get(bucket_keys.STEP_RECORD_NAME)
    if entry is None:
        return None
    data = read_verified(bucket, manifest.file_key(run, bucket_keys.STEP_RECORD_NAME), entry.sha256)
    return StepRecord.model_validate_json(data)


def same_bytes(manifest: Manifest, files: dict[str, bytes]) -> bool:
    """True if ``files`` are exactly what ``manifest`` lists (a stored manifest may be another attempt's)."""
    return set(files) == set(manifest.files) and all(
        sha256_hex(data) == manifest.files[name].sha256 for name, data in files.items()
    )


def published_is_ours(step: int, manifest_sha: str, client: ProxyClient) -> bool:
    """True if the proxy recorded our manifest as version ``step`` (the sha it published, not the bucket's)."""
    try:
        return client.version_info(step).manifest_sha256 == manifest_sha
    except NotFound:
        return False
