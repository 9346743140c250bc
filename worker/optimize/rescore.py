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

Where the generator-trainer correction applies (``loss.vllm_importance_sampling_correction``, samples marked
``corrected``), the trainer's logprobs under the claimed version are the PPO denominator of every such
sequence, so all of them are rescored (not a fraction), per token: each one's ``old_logprobs`` is set, and
its ratio sums are those of the correction weight exp(trainer - generator).

Every ratio and token count here is over the model's tokens: an agent sample's tool tokens carry no
behaviour logprob to check.

A sequence that followed newer versions while it was sampled (``async.inflight_versions = "follow"``) is checked
segment by segment: under each version it holds, the tokens that version sampled (``TrainSample.segment``), so
each token is compared with its own version's logprob and the sums of its segments add up to the sequence's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import structlog
import torch

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.bucket.layout import IntegrityError, read_manifest, read_verified
from asyncgrpo.protocol.records import FlaggedRollout
from worker.algo.rollout import Rollout
from worker.optimize.batch import TrainSample
from worker.optimize.trainer import RatioSums, Trainer

log = structlog.get_logger()


class RecentAdapterWeights:
    """LoRA weights of recent versions, by (run, version): the versions this process published or fetched for
    rescoring, as safetensors bytes or, once decoded, as tensors in the trainer's parameter order (a swap is
    then a copy, not a parse and a PEFT state-dict load). Versions are immutable, so a copy is as good as the
    bucket's, and steady-state rescoring of stale rollouts reads nothing from the bucket. One per trainer
    (``worker.optimize.job.Optimizer``); an empty one rescores from the bucket alone."""

    def __init__(self) -> None:
        self._weights: dict[tuple[str, int], bytes | list[torch.Tensor]] = {}

    def get(self, run: str, version: int) -> bytes | list[torch.Tensor] | None:
        return self._weights.get((run, version))

    def remember(self, run: str, version: int, weights: bytes | list[torch.Tensor]) -> None:
        """Keep the weights of a version this process just wrote or read (its safetensors bytes, or copies of
        the trainer's LoRA parameters in their order): rescoring its rollouts then reads and parses nothing."""
        self._weights[(run, version)] = weights

    def forget(self, run: str, version: int) -> None:
        """Drop a version this process wrote but lost to another trainer: the published one differs."""
        self._weights.pop((run, version), None)

    def keep_from(self, run: str, oldest: int) -> None:
        """Forget every version older than ``oldest`` and every other run's: only the window can be claimed."""
        for key in [key for key in self._weights if key[0] != run or key[1] < oldest]:
            del self._weights[key]

    def versions(self, run: str) -> list[int]:
        """The versions of ``run`` held (for tests and logs)."""
        return sorted(version for name, version in self._weights if name == run)


def _fits(trainer: Trainer, values: list[torch.Tensor]) -> bool:
    parameters = trainer.lora_parameters
    return len(values) == len(parameters) and all(
        v.shape == p.shape and v.device == p.device for v, p in zip(values, parameters, strict=True)
    )


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
    samples: list[TrainSample] | None = None,
) -> RescorePlan:
    """The rescoring plan of one step; ``first_update`` holds the indices of the samples its first optimizer
    update trains on, ``fraction`` is ``loss.rescore_stale_fraction`` and ``seed`` fixes the sample. A rollout
    whose ``samples`` are ``corrected`` has every sequence the training forward does not serve rescored."""

    def rollout_corrected(indices: list[int]) -> bool:
        return samples is not None and samples[indices[0]].corrected

    def versions(index: int, owner: int) -> list[int]:
        return samples[index].versions() if samples is not None else [rollouts[owner].version]

    reuse = trainer.training_forward_is_eval_forward
    first = set(first_update)
    plan = RescorePlan()
    others: dict[int, list[int]] = {}
    for index, owner in enumerate(sample_rollout):
        if reuse and versions(index, owner) == [base_version] and index in first:
            plan.reused.append(index)
        else:
            others.setdefault(owner, []).append(index)
    rng = random.Random(seed)
    for owner, indices in sorted(others.items()):
        whole = fraction >= 1.0 or rollout_corrected(indices)
        count = len(indices) if whole else math.ceil(fraction * len(indices))  # >= 1
        for index in sorted(rng.sample(indices, count)):
            for version in versions(index, owner):  # a sequence that followed new versions: each segment
                plan.separate.setdefault(version, []).append(index)
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
    recorded_sha: Callable[[int], str] | None = None,
    recent: RecentAdapterWeights | None = None,
) -> dict[int, RatioSums]:
    """Run the plan's separate rescoring: per rescored sample index, the sums over its tokens of
    exp(logprob under its claimed version - behaviour logprob) and of its log. Call before the step changes
    the weights.

    With the right weights served each term is 1 whatever the staleness. Versions inside the staleness window
    are never collected (invariant 3), so their adapters are still in the bucket; each is checked against
    its manifest, and the manifest against ``recorded_sha(version)``, the sha the proxy recorded at publish.
    ``recent`` holds the weights already read or written (None: read every version from the bucket).
    """
    if recent is None:
        recent = RecentAdapterWeights()
    # Only versions inside the window can be claimed again: forget older weights.
    recent.keep_from(run, min(r.version for r in rollouts))
    sums: dict[int, RatioSums] = {}
    for version, indices in sorted(plan.separate.items()):
        weights: bytes | list[torch.Tensor] | None = None
        if version != base_version:
            weights = recent.get(run, version)
            if weights is None or (isinstance(weights, list) and not _fits(trainer, weights)):
                manifest, manifest_sha = read_manifest(bucket, run, version)
                if recorded_sha is not None and manifest_sha != recorded_sha(version):
                    manifest_key = bucket_keys.manifest_key(run, version)
                    raise IntegrityError(
                        f"{manifest_key} has sha256 {manifest_sha}, not the one the proxy published", key=manifest_key
                    )
                key = manifest.file_key(run, bucket_keys.ADAPTER_WEIGHTS_NAME)  # the attempt it names
                weights = read_verified(bucket, key, manifest.files[bucket_keys.ADAPTER_WEIGHTS_NAME].sha256)
                recent.remember(run, version, weights)
            if isinstance(weights, bytes):
                weights = trainer.lora_values(weights)
                recent.remember(run, version, weights)
        # Under that version's LoRA for the moment (None: the trainer's own); the trainer puts its own back.
        corrected = [i for i in indices if samples[i].corrected]
        checked = [i for i in indices if not samples[i].corrected]
        if checked:
            scored = trainer.rescore_ratio_sums([samples[i].segment(version) for i in checked], lora_values=weights)
            for index, (ratio, log_ratio) in zip(checked, scored, strict=True):
                earlier = sums.get(index, (0.0, 0.0))  # another segment's, under another version
                sums[index] = (earlier[0] + ratio, earlier[1] + log_ratio)
        if corrected:
            logprobs = trainer.rescore([samples[i] for i in corrected], lora_values=weights)
            for index, current in zip(corrected, logprobs, strict=True):
                samples[index].old_logprobs = _merged(samples[index], version, current)
    for index in {i for indices in plan.separate.values() for i in indices if samples[i].corrected}:
        old = samples[index].old_logprobs
        assert old is not None
        sums[index] = _sequence_ratio_sums(samples[index], old)
    return sums


def _merged(sample: TrainSample, version: int, current: list[float]) -> list[float]:
    """``sample``'s rescored logprobs with ``version``'s tokens taken from ``current`` (every token, for a sample of
    one version); the other segments' come from their own versions' rescoring."""
    if sample.token_versions is None:
        return current
    merged = list(sample.old_logprobs) if sample.old_logprobs is not None else [0.0] * len(current)
    for position, token_version in enumerate(sample.token_versions):
        if token_version == version:
            merged[position] = current[position]
    return merged


def _sequence_ratio_sums(sample: TrainSample, current: list[float]) -> RatioSums:
    """The ratio sums of ``sample`` with ``current`` logprobs, over its model tokens (a tool token's
    behaviour logprob is meaningless)."""
    pairs = zip(sample.behavior_logprobs, current, sample.model_flags(), strict=True)
    log_ratios = [c - b for b, c, model in pairs if model]
    return sum(math.exp(value) for value in log_ratios), sum(log_ratios)


@dataclass
class RolloutRatios:
    """Per rollout, token means over its checked samples' model tokens (None for a rollout with none):
    ``mean`` of the ratio (the figure reported), ``geometric`` mean exp(mean log ratio)."""

    mean: list[float | None]
    geometric: list[float | None]


def ratios_by_rollout(
    samples: list[TrainSample], ratio_sums: dict[int, RatioSums], sample_rollout: list[int], count: int
) -> RolloutRatios:
    """Per rollout, the ratios of its checked samples (``ratio_sums`` by sample index), token means over the
    model's tokens (the sums hold only those)."""
    sums = [0.0] * count
    log_sums = [0.0] * count
    tokens = [0] * count
    for index, (ratio, log_ratio) in ratio_sums.items():
        owner = sample_rollout[index]
        sums[owner] += ratio
        log_sums[owner] += log_ratio
        tokens[owner] += samples[index].model_tokens
    return RolloutRatios(
        mean=[sums[i] / tokens[i] if tokens[i] else None for i in range(count)],
        geometric=[math.exp(log_sums[i] / tokens[i]) if tokens[i] else None for i in range(count)],
    )


def flag_drifting_rollouts(
    rollouts: list[Rollout], ratios: RolloutRatios | list[float | None], tolerance: float
) -> list[FlaggedRollout]:
    """The rollouts whose rescoring ratio is further than ``tolerance`` from 1, each logged with its worker.

    The mean ratio alone is a weak test: under the behaviour policy E[exp(logp - behaviour)] = 1 for *any*
    weights, so wrong weights show only through noise, less on some samples than others. The geometric mean
    exp(mean log ratio) tends to exp(-KL(behaviour || rescoring)) < 1 instead, so it is also checked (with
    the right weights both are 1 on every token).
    """
    if not isinstance(ratios, RolloutRatios):
        ratios = RolloutRatios(mean=list(ratios), geometric=[None] * len(ratios))
    flagged = []
    for rollout, ratio, geometric in zip(rollouts, ratios.mean, ratios.geometric, strict=True):
        drift = max((abs(value - 1.0) for value in (ratio, geometric) if value is not None), default=0.0)
        if ratio is not None and drift > tolerance:
            flagged.append(FlaggedRollout(task_id=rollout.task_id, worker_id=rollout.worker_id, ratio=ratio))
            log.warning(
                "optimize.rollout_ratio_drift",
                hint="its worker may serve the wrong weights",
                task_id=rollout.task_id,
                worker=rollout.worker_id,
                version=rollout.version,
                ratio=ratio,
                geometric_ratio=geometric,
            )
    return flagged
