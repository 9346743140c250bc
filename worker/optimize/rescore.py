"""Rescoring a claimed batch under the versions its rollouts claim: the check that a generate worker served
the weights it leased.

With the right weights served, a rollout's rescored logprobs equal its behaviour logprobs (ratio 1) whatever
its staleness; one whose mean ratio drifts beyond ``loss.ratio_flag_tolerance`` is flagged with its worker.
Rescoring under an older version swaps that version's LoRA weights into the trainer for the moment and
restores its own exactly afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import structlog
import torch

from proxy.protocol.records import FlaggedRollout
from proxy.storage import bucket_keys
from proxy.storage.bucket import Bucket
from proxy.storage.manifest import read_manifest, read_verified
from worker.algo.rollout import Rollout
from worker.model.policy import TRAIN_ADAPTER
from worker.optimize.batch import TrainSample
from worker.optimize.trainer import Trainer
from worker.optimize.trainer_state import load_adapter_weights

log = structlog.get_logger()

# Adapter weights of recent versions, by (run, version): the versions this process published or fetched
# for rescoring. Versions are immutable, so a copy is as good as the bucket's, and steady-state rescoring
# of stale rollouts reads nothing from the bucket.
_recent_adapter_weights: dict[tuple[str, int], bytes] = {}


@contextmanager
def _weights_of_version(trainer: Trainer, adapter_weights: bytes) -> Iterator[None]:
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
    trainer: Trainer,
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


def ratios_by_rollout(
    samples: list[TrainSample], new_logprobs: list[list[float]], sample_rollout: list[int], count: int
) -> list[float | None]:
    sums = [0.0] * count
    tokens = [0] * count
    for sample, logprobs, owner in zip(samples, new_logprobs, sample_rollout, strict=True):
        for new, old in zip(logprobs, sample.behavior_logprobs, strict=True):
            sums[owner] += math.exp(new - old)
            tokens[owner] += 1
    return [sums[i] / tokens[i] if tokens[i] else None for i in range(count)]


def remember_adapter_weights(run: str, version: int, weights: bytes) -> None:
    """Keep the weights of a version this process just wrote: rescoring its rollouts then reads nothing."""
    _recent_adapter_weights[(run, version)] = weights


def forget_adapter_weights(run: str, version: int) -> None:
    """Drop a version this process wrote but lost to another trainer: the published one differs."""
    _recent_adapter_weights.pop((run, version), None)


def flag_drifting_rollouts(
    rollouts: list[Rollout], ratios: list[float | None], tolerance: float
) -> list[FlaggedRollout]:
    """The rollouts whose rescoring ratio is further than ``tolerance`` from 1, each logged with its worker."""
    flagged = []
    for rollout, ratio in zip(rollouts, ratios, strict=True):
        if ratio is not None and abs(ratio - 1.0) > tolerance:
            flagged.append(FlaggedRollout(task_id=rollout.task_id, worker_id=rollout.worker_id, ratio=ratio))
            log.warning(
                "optimize.rollout_ratio_drift",
                hint="its worker may serve the wrong weights",
                task_id=rollout.task_id, worker=rollout.worker_id, version=rollout.version, ratio=ratio,
            )
    return flagged
