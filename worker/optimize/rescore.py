"""Rescoring a claimed batch under the versions its rollouts claim: the check that a generate worker served
the weights it leased.

With the right weights served, a rollout's rescored logprobs equal its behaviour logprobs (ratio 1) whatever
its staleness; one whose mean ratio drifts beyond ``loss.ratio_flag_tolerance`` is flagged with its worker.
A correct generator gives ratio 1 on every token, so checking a sample of a rollout's sequences cannot flag
it wrongly, and a wrong one drifts on every token, so a sample still shows it. Hence the plan: fresh samples
of the first update reuse the training forward (no extra forward at all); the others, a seeded
``loss.rescore_stale_fraction`` of each rollout (at least one sequence), are rescored separately, under an
older version by swapping its LoRA weights into the trainer for the moment and restoring its own exactly
afterwards.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

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


@dataclass
class RescorePlan:
    """Which samples check their rollout's ratio, and how.

    ``reused``: fresh samples trained in the step's first update, whose training forward runs under exactly
    the version they claim (no active dropout), so its detached logprobs are their rescoring. ``separate``:
    by claimed version, a seeded sample of the others (stale rollouts; fresh ones the training forward cannot
    serve), rescored in their own forward; every rollout keeps at least one checked sequence.
    """

    reused: list[int] = field(default_factory=list)
    separate: dict[int, list[int]] = field(default_factory=dict)

    @property
    def rescored(self) -> int:
        """Sequences rescored in a separate forward."""
        return sum(len(indices) for indices in self.separate.values())


def plan_rescoring(
    trainer: Trainer,
    rollouts: list[Rollout],
    sample_rollout: list[int],
    *,
    base_version: int,
    first_update: Collection[int],
    fraction: float,
    seed: int,
) -> RescorePlan:
    """The rescoring plan of one step; ``first_update`` holds the indices of the samples its first optimizer
    update trains on, ``fraction`` is ``loss.rescore_stale_fraction`` and ``seed`` fixes the sample."""
    reuse = trainer.training_forward_is_eval_forward
    first = set(first_update)
    plan = RescorePlan()
    others: dict[int, list[int]] = {}
    for index, owner in enumerate(sample_rollout):
        if reuse and rollouts[owner].version == base_version and index in first:
            plan.reused.append(index)
        else:
            others.setdefault(owner, []).append(index)
    rng = random.Random(seed)
    for owner, indices in sorted(others.items()):
        count = len(indices) if fraction >= 1.0 else math.ceil(fraction * len(indices))  # >= 1
        chosen = sorted(rng.sample(indices, count))
        plan.separate.setdefault(rollouts[owner].version, []).extend(chosen)
    for indices in plan.separate.values():
        indices.sort()
    return plan


def rescore_planned(
    trainer: Trainer,
    bucket: Bucket,
    run: str,
    base_version: int,
    rollouts: list[Rollout],
    samples: list[TrainSample],
    plan: RescorePlan,
) -> dict[int, float]:
    """Run the plan's separate rescoring: per rescored sample index, the sum over its tokens of
    exp(logprob under its claimed version - behaviour logprob). Call before the step changes the weights.

    With the right weights served each term is 1 whatever the staleness. Versions inside the staleness window
    are never collected (invariant 3), so their adapters are still in the bucket; each is checked against
    its manifest.
    """
    # Only versions inside the window can be claimed again: forget older weights.
    oldest = min(r.version for r in rollouts)
    for stale_key in [k for k in _recent_adapter_weights if k[0] != run or k[1] < oldest]:
        del _recent_adapter_weights[stale_key]
    sums: dict[int, float] = {}
    for version, indices in sorted(plan.separate.items()):
        subset = [samples[i] for i in indices]
        if version == base_version:
            scored = trainer.rescore_ratio_sums(subset)
        else:
            weights = _recent_adapter_weights.get((run, version))
            if weights is None:
                manifest, _ = read_manifest(bucket, run, version)
                key = bucket_keys.adapter_file_key(run, version, bucket_keys.ADAPTER_WEIGHTS_NAME)
                weights = read_verified(bucket, key, manifest.files[bucket_keys.ADAPTER_WEIGHTS_NAME].sha256)
                _recent_adapter_weights[(run, version)] = weights
            with _weights_of_version(trainer, weights):
                scored = trainer.rescore_ratio_sums(subset)
        sums.update(zip(indices, scored, strict=True))
    return sums


def ratios_by_rollout(
    samples: list[TrainSample], ratio_sums: dict[int, float], sample_rollout: list[int], count: int
) -> list[float | None]:
    """Per rollout, the token mean of the ratio over its checked samples (``ratio_sums`` by sample index);
    None for a rollout with no checked completion token."""
    sums = [0.0] * count
    tokens = [0] * count
    for index, value in ratio_sums.items():
        owner = sample_rollout[index]
        sums[owner] += value
        tokens[owner] += len(samples[index].completion_token_ids)
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
