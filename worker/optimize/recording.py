"""The step record of one optimize step: what it trained on and how the policy moved.

``build_step_record`` turns the step's rollouts, their rescoring ratios and the trainer's per-update metrics
into a ``asyncgrpo.protocol.records.StepRecord``; the optimize job stores it with the new version and copies it
to ``runs/<run>/metrics/``. Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
import time

from asyncgrpo.protocol.records import FlaggedRollout, RolloutEntry, StepRecord, StepTimings, UpdateMetrics
from asyncgrpo.protocol.staleness import staleness
from worker.algo.rollout import Rollout


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _std(values: list[float]) -> float | None:
    """Population std (all completions of the step are the population)."""
    mean = _mean(values)
    return math.sqrt(sum((x - mean) ** 2 for x in values) / len(values)) if mean is not None else None


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
) -> StepRecord:
    """The record of step ``step`` (from ``base_version``); ``ratios`` are the rollouts' rescoring ratios."""
    samples = [sample for rollout in rollouts for sample in rollout.samples]
    rewards = [sample.reward for sample in samples]
    stalenesses = [staleness(base_version, rollout.version) for rollout in rollouts]
    reward_names = sorted({name for sample in samples for name in sample.rewards_by_name})
    by_name = {name: [sample.rewards_by_name.get(name, 0.0) for sample in samples] for name in reward_names}
    completion_lengths = [len(sample.completion_token_ids) for sample in samples]
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
    )
