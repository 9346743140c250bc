"""One optimize task as a plain function: one published version from one claimed batch.

Steps: make sure the trainer holds version ``base_version`` (memory when it matches, else the bucket),
fetch the claimed rollouts (sha256 checked), check staleness again, rescore them under ``base_version``
(the ratio check that flags a generator serving the wrong weights), take ``publish_every`` optimizer
updates, upload version ``step`` (files first, manifest last), publish it by compare-and-set, and copy the
step record to ``metrics/step-S.json``.

Idempotent: a redelivered step that is already published is a no-op; one whose upload finished but whose
publish did not (the worker died in between) publishes the uploaded version instead of training again.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch

from proxy.protocol.client import Conflict, ProxyClient
from proxy.protocol.staleness import check_fresh, staleness
from proxy.run.config import RunConfig
from proxy.storage import bucket_keys
from proxy.storage.bucket import Bucket, ObjectNotFound
from proxy.storage.manifest import IntegrityError, delete_version, read_manifest, read_verified, write_version
from worker.algo.rollout import Rollout, decode_rollout
from worker.model.policy import TRAIN_ADAPTER
from worker.optimize.trainer import TrainSample
from worker.optimize.trainer_state import load_adapter_weights

log = structlog.get_logger()

STEP_RECORD_NAME = "step_record.json"


class TrainerLike(Protocol):
    version: int | None  # the published version the in-memory state equals; None when unknown or dirty

    def rescore(self, samples: list[TrainSample]) -> list[list[float]]: ...
    def step(self, samples: list[TrainSample]) -> Any: ...
    def version_files(self, version: int, extra: dict[str, Any] | None = None) -> dict[str, bytes]: ...
    def load_version_files(self, files: dict[str, bytes]) -> int: ...


@dataclass
class OptimizeResult:
    step: int
    status: str  # published | already_published | republished | conflict
    version: int
    record: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        brief = {}
        if self.record:
            brief = {k: self.record.get(k) for k in ("samples", "reward_mean", "ratio", "max_staleness", "step_s")}
        return {"step": self.step, "status": self.status, "version": self.version, **brief}


def load_trainer_version(trainer: TrainerLike, bucket: Bucket, run: str, version: int) -> None:
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
        log.warning("discarding a broken earlier upload", step=step, error=str(error))
        delete_version(bucket, run, step)
        return None
    return manifest_sha


def _copy_step_record(bucket: Bucket, run: str, step: int) -> dict[str, Any] | None:
    manifest, _ = read_manifest(bucket, run, step)
    entry = manifest.files.get(STEP_RECORD_NAME)
    if entry is None:
        return None
    data = read_verified(bucket, bucket_keys.adapter_file_key(run, step, STEP_RECORD_NAME), entry.sha256)
    bucket.put(bucket_keys.metrics_key(run, step), data)
    return json.loads(data)


def run_initialize(
    *, run: str, trainer: TrainerLike, bucket: Bucket, client: ProxyClient, worker_id: str
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
        client.publish(version=0, base_version=-1, step=0, worker_id=worker_id, manifest_sha256=manifest_sha)
    except Conflict as error:
        log.warning("version 0 publish lost the compare-and-set", error=str(error))
        return OptimizeResult(step=0, status="conflict", version=0)
    trainer.version = 0
    return OptimizeResult(step=0, status="published", version=0)


def run_optimize_step(
    *,
    run: str,
    step: int,
    base_version: int,
    rollout_refs: list[dict[str, Any]],
    config: RunConfig,
    trainer: TrainerLike,
    bucket: Bucket,
    client: ProxyClient,
    worker_id: str,
) -> OptimizeResult:
    started = time.perf_counter()
    if step != base_version + 1:
        raise ValueError(f"optimize step {step} must start from version {step - 1}, not {base_version}")
    current = client.run_info().current_version
    if current >= step:
        log.info("step already published; redelivery is a no-op", step=step, current=current)
        _ensure_step_record(bucket, run, step)
        return OptimizeResult(step=step, status="already_published", version=current)

    manifest_sha = _uploaded_attempt(bucket, run, step, base_version)
    record: dict[str, Any] | None = None
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
    try:
        client.publish(
            version=step, base_version=base_version, step=step, worker_id=worker_id, manifest_sha256=manifest_sha
        )
    except Conflict as error:
        if not _published_is_ours(bucket, run, step, manifest_sha, client):
            # Someone else published this version (we were a zombie or a redelivery): drop our work.
            log.warning("publish lost the compare-and-set; dropping this step's work", step=step, error=str(error))
            trainer.version = None  # force a reload from the bucket next time
            _recent_adapter_weights.pop((run, step), None)
            _ensure_step_record(bucket, run, step)
            return OptimizeResult(step=step, status="conflict", version=step)
        # Our upload is the published version: a rebuilt proxy adopted it from the bucket, or our first
        # publish went through and only its answer was lost.
        log.info("our upload was already published", step=step)
    record = _copy_step_record(bucket, run, step) or record
    return OptimizeResult(step=step, status=status, version=step, record=record)


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
        log.warning("step record lost with its collected version", step=step)


def _fetch_rollouts(bucket: Bucket, refs: list[dict[str, Any]]) -> list[Rollout]:
    rollouts = []
    for ref in refs:
        data = read_verified(bucket, ref["key"], ref["sha256"])
        rollout = decode_rollout(data)
        if rollout.version != ref["version"] or rollout.task_id != ref["task_id"]:
            raise IntegrityError(
                f"rollout {ref['key']} says version {rollout.version}/task {rollout.task_id}, but the claim names "
                f"version {ref['version']}/task {ref['task_id']}"
            )
        rollouts.append(rollout)
    return rollouts


def _train_and_upload(
    run: str,
    step: int,
    base_version: int,
    refs: list[dict[str, Any]],
    config: RunConfig,
    trainer: TrainerLike,
    bucket: Bucket,
    worker_id: str,
    started: float,
) -> tuple[dict[str, Any], str]:
    if trainer.version != base_version:
        load_started = time.perf_counter()
        load_trainer_version(trainer, bucket, run, base_version)
        load_s = time.perf_counter() - load_started
        log.info("trainer state loaded from the bucket", version=base_version, seconds=load_s)

    fetch_started = time.perf_counter()
    rollouts = _fetch_rollouts(bucket, refs)
    fetch_s = time.perf_counter() - fetch_started
    max_staleness = config.async_.max_staleness
    for rollout in rollouts:
        # Invariant 2, checked again where the gradient is made: the proxy should never send these.
        check_fresh(base_version, rollout.version, max_staleness)

    samples, sample_keys = build_train_samples(rollouts)
    sample_rollout = [owner for owner, _ in sample_keys]
    rescore_started = time.perf_counter()
    new_logprobs = rescore_under_claimed_versions(trainer, bucket, run, base_version, rollouts, samples, sample_rollout)
    rescore_s = time.perf_counter() - rescore_started
    rollout_ratios = _ratios_by_rollout(samples, new_logprobs, sample_rollout, len(rollouts))
    tolerance = config.loss.ratio_flag_tolerance
    flagged = []
    for rollout, ratio in zip(rollouts, rollout_ratios, strict=True):
        if ratio is not None and abs(ratio - 1.0) > tolerance:
            flagged.append({"task_id": rollout.task_id, "worker_id": rollout.worker_id, "ratio": ratio})
            log.warning(
                "rollout ratio drifts from 1: its worker may serve the wrong weights",
                task_id=rollout.task_id, worker=rollout.worker_id, version=rollout.version, ratio=ratio,
            )

    updates = config.async_.publish_every
    step_metrics = [trainer.step(chunk) for chunk in _split_by_group(samples, sample_keys, updates)]
    trainer.version = None  # dirty until the new version's files are written

    files = trainer.version_files(step)
    all_rewards = [s.reward for r in rollouts for s in r.samples]
    record = _step_record(
        run, step, base_version, worker_id, rollouts, rollout_ratios, flagged, step_metrics, all_rewards,
        {"fetch_s": fetch_s, "rescore_s": rescore_s, "step_s": time.perf_counter() - started},
    )
    files[STEP_RECORD_NAME] = json.dumps(record, sort_keys=True).encode()
    publish_started = time.perf_counter()
    metadata = {
        "step": step,
        "base_version": base_version,
        "worker_id": worker_id,
        "rollouts": [r.task_id for r in rollouts],
    }
    _, manifest_sha = write_version(bucket, run, step, files, metadata)
    _recent_adapter_weights[(run, step)] = files[bucket_keys.ADAPTER_WEIGHTS_NAME]
    record["timings"]["upload_s"] = time.perf_counter() - publish_started
    return record, manifest_sha


# Adapter weights of recent versions, by (run, version): the versions this process published or fetched
# for rescoring. Versions are immutable, so a copy is as good as the bucket's, and steady-state rescoring
# of stale rollouts reads nothing from the bucket.
_recent_adapter_weights: dict[tuple[str, int], bytes] = {}


@contextmanager
def _weights_of_version(trainer: Any, adapter_weights: bytes) -> Iterator[None]:
    """Temporarily give the trainer's LoRA the weights of another version (exact copy back afterwards)."""
    saved = [parameter.detach().clone() for parameter in trainer.lora_parameters]
    load_adapter_weights(trainer.model, adapter_weights, TRAIN_ADAPTER)
    try:
        yield
    finally:
        with torch.no_grad():
            for parameter, value in zip(trainer.lora_parameters, saved, strict=True):
                parameter.copy_(value)


def rescore_under_claimed_versions(
    trainer: Any,
    bucket: Bucket,
    run: str,
    base_version: int,
    rollouts: list[Rollout],
    samples: list[TrainSample],
    sample_rollout: list[int],
) -> list[list[float]]:
    """Each sample's logprobs under the version its rollout claims to come from.

    With the right weights served, these equal the behaviour logprobs (ratio 1) whatever the staleness; a
    rollout whose ratio drifts is flagged. Versions inside the staleness window are never collected
    (invariant 3), so their adapters are still in the bucket; each is checked against its manifest.
    """
    # Only versions inside the window can be claimed again: forget older weights.
    for stale_key in [k for k in _recent_adapter_weights if k[0] != run or k[1] < min(r.version for r in rollouts)]:
        del _recent_adapter_weights[stale_key]
    indices_by_version: dict[int, list[int]] = {}
    for index, owner in enumerate(sample_rollout):
        indices_by_version.setdefault(rollouts[owner].version, []).append(index)
    logprobs: list[list[float]] = [[] for _ in samples]
    for version, indices in sorted(indices_by_version.items()):
        subset = [samples[i] for i in indices]
        if version == base_version:
            scored = trainer.rescore(subset)
        else:
            weights = _recent_adapter_weights.get((run, version))
            if weights is None:
                manifest, _ = read_manifest(bucket, run, version)
                key = bucket_keys.adapter_file_key(run, version, bucket_keys.ADAPTER_WEIGHTS_NAME)
                weights = read_verified(bucket, key, manifest.files[bucket_keys.ADAPTER_WEIGHTS_NAME].sha256)
                _recent_adapter_weights[(run, version)] = weights
            with _weights_of_version(trainer, weights):
                scored = trainer.rescore(subset)
        for index, values in zip(indices, scored, strict=True):
            logprobs[index] = values
    return logprobs


def _ratios_by_rollout(
    samples: list[Any], new_logprobs: list[list[float]], sample_rollout: list[int], count: int
) -> list[float | None]:
    sums = [0.0] * count
    tokens = [0] * count
    for sample, logprobs, owner in zip(samples, new_logprobs, sample_rollout, strict=True):
        for new, old in zip(logprobs, sample.behavior_logprobs, strict=True):
            sums[owner] += math.exp(new - old)
            tokens[owner] += 1
    return [sums[i] / tokens[i] if tokens[i] else None for i in range(count)]


def build_train_samples(rollouts: list[Rollout]) -> tuple[list[TrainSample], list[tuple[int, int]]]:
    """Flatten rollouts into train samples; also return each sample's (rollout index, group index)."""
    samples: list[TrainSample] = []
    keys: list[tuple[int, int]] = []
    for owner, rollout in enumerate(rollouts):
        for sample in rollout.samples:
            samples.append(
                TrainSample(
                    prompt_token_ids=sample.prompt_token_ids,
                    completion_token_ids=sample.completion_token_ids,
                    behavior_logprobs=sample.behavior_logprobs,
                    advantage=sample.advantage,
                    version=rollout.version,
                )
            )
            keys.append((owner, sample.group_index))
    return samples, keys


def _split_by_group(samples: list[TrainSample], keys: list[tuple[int, int]], parts: int) -> list[list[TrainSample]]:
    """Split the batch into ``parts`` optimizer updates without cutting a group."""
    if parts == 1:
        return [samples]
    keyed: dict[tuple[int, int], list[TrainSample]] = {}
    for sample, key in zip(samples, keys, strict=True):
        keyed.setdefault(key, []).append(sample)
    groups = list(keyed.values())
    size = math.ceil(len(groups) / parts)
    return [[s for g in groups[i : i + size] for s in g] for i in range(0, len(groups), size)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _std(values: list[float]) -> float | None:
    """Population std (all completions of the step are the population)."""
    mean = _mean(values)
    return math.sqrt(sum((x - mean) ** 2 for x in values) / len(values)) if values else None


def _step_record(
    run: str,
    step: int,
    base_version: int,
    worker_id: str,
    rollouts: list[Rollout],
    ratios: list[float | None],
    flagged: list[dict[str, Any]],
    step_metrics: list[Any],
    rewards: list[float],
    timings: dict[str, float],
) -> dict[str, Any]:
    metrics = [m.to_dict() for m in step_metrics]
    stalenesses = [staleness(base_version, r.version) for r in rollouts]
    samples = sum(len(r.samples) for r in rollouts)
    reward_names = sorted({n for r in rollouts for s in r.samples for n in s.rewards_by_name})
    completion_lengths = [len(s.completion_token_ids) for r in rollouts for s in r.samples]
    truncated = sum(1 for r in rollouts for s in r.samples if s.finish_reason == "length")
    by_name = {name: [s.rewards_by_name.get(name, 0.0) for r in rollouts for s in r.samples] for name in reward_names}

    def metric_mean(name: str) -> float | None:
        values = [m[name] for m in metrics if m.get(name) is not None]
        return _mean(values)

    return {
        "run": run,
        "step": step,
        "version": step,
        "base_version": base_version,
        "worker_id": worker_id,
        "published_at": time.time(),
        "samples": samples,
        "groups": sum(len(r.groups) for r in rollouts),
        "tokens": sum(completion_lengths),
        "reward_mean": _mean(rewards),
        "reward_std": _std(rewards),
        "rewards_by_name": {name: _mean(values) for name, values in by_name.items()},
        "rewards_std_by_name": {name: _std(values) for name, values in by_name.items()},
        "completion_length_mean": _mean([float(x) for x in completion_lengths]),
        "truncated_fraction": truncated / samples if samples else 0.0,
        "staleness": stalenesses,
        "max_staleness": max(stalenesses) if stalenesses else 0,
        "ratio": metric_mean("ratio"),
        "rescore_ratio": _mean([r for r in ratios if r is not None]),
        "kl": metric_mean("kl"),
        "entropy": metric_mean("entropy"),
        "clip_low": metric_mean("clip_low"),
        "clip_high": metric_mean("clip_high"),
        "clip_region": metric_mean("clip_region"),
        "loss": metric_mean("loss"),
        "grad_norm": metric_mean("grad_norm"),
        "lr": metric_mean("lr"),
        "updates": metrics,
        "rollouts": [
            {"task_id": r.task_id, "version": r.version, "worker_id": r.worker_id, "ratio": ratio,
             "group_ids": [g["group_id"] for g in r.groups],
             "prompt_indices": [g["prompt_index"] for g in r.groups], "samples": len(r.samples)}
            for r, ratio in zip(rollouts, ratios, strict=True)
        ],
        "flagged_rollouts": flagged,
        "timings": timings,
    }
