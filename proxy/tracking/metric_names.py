"""What a tracker receives: a step record or an eval record turned into a flat ``name -> float`` map.

Names follow TRL's GRPOTrainer where it logs the same figure (``reward``, ``reward_std``,
``rewards/<name>/mean``, ``kl``, ``entropy``, ``clip_ratio/low_mean``, ``completions/mean_length``, ...), so
dashboards built for TRL runs read ours; figures TRL has no name for are under ``asyncgrpo/``. A value the
record does not have (None: a mean over nothing) is left out rather than logged as 0. Eval results are logged
as ``eval/<name>``. Pure: no tracker library, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from asyncgrpo.protocol.records import StepRecord

EVAL_PREFIX = "eval/"
OURS = "asyncgrpo/"


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def step_metrics(record: StepRecord) -> dict[str, float]:
    """The tracker metrics of one published step (logged at step ``record.step``)."""
    named: dict[str, float | int | None] = {
        "reward": record.reward_mean,
        "reward_std": record.reward_std,
        "kl": record.kl,
        "entropy": record.entropy,
        "clip_ratio/low_mean": record.clip_low,
        "clip_ratio/high_mean": record.clip_high,
        "clip_ratio/region_mean": record.clip_region,
        "completions/mean_length": record.completion_length_mean,
        "completions/clipped_ratio": record.truncated_fraction,
        "loss": record.loss,
        "grad_norm": record.grad_norm,
        "learning_rate": record.lr,
    }
    if record.importance_sampling_ratio is not None:
        figures = record.importance_sampling_ratio
        named["sampling/importance_sampling_ratio/min"] = figures.min
        named["sampling/importance_sampling_ratio/mean"] = figures.mean
        named["sampling/importance_sampling_ratio/max"] = figures.max
        named["sampling/sampling_logp_difference/mean"] = figures.logp_difference_mean
        named["sampling/sampling_logp_difference/max"] = figures.logp_difference_max
    if record.tools is not None:
        named["tools/call_frequency"] = record.tools.call_frequency
        named["tools/failure_frequency"] = record.tools.failure_frequency
    for name, mean in record.rewards_by_name.items():
        named[f"rewards/{name}/mean"] = mean
        named[f"rewards/{name}/std"] = record.rewards_std_by_name.get(name)
    kl_ref = [update.kl_ref for update in record.updates if update.kl_ref is not None]
    ours: dict[str, float | int | None] = {
        # TRL's step counts optimizer updates; a published version holds async.publish_every of them.
        "optimizer_steps": record.updates[-1].update + 1 if record.updates else None,
        "max_staleness": record.max_staleness,
        "token_staleness/mean": record.token_staleness_mean,
        "token_staleness/max": record.token_staleness_max,
        "token_staleness/masked": record.masked_stale_tokens,
        "mean_staleness": (
            sum(record.staleness_per_sample()) / len(record.staleness_per_sample())
            if record.staleness_per_sample()
            else None
        ),
        "ratio": record.ratio,
        "rescore_ratio": record.rescore_ratio,
        "kl_ref": sum(kl_ref) / len(kl_ref) if kl_ref else None,
        "tokens": record.tokens,
        "samples": record.samples,
        "groups": record.groups,
        "flagged_rollouts": len(record.flagged_rollouts),
    }
    ours.update({f"timings/{phase}": seconds for phase, seconds in record.timings.model_dump().items()})
    named.update({OURS + name: value for name, value in ours.items()})
    return {name: number for name, value in named.items() if (number := _finite(value)) is not None}


def eval_metrics(record: dict[str, Any]) -> dict[str, float]:
    """``eval/<name>`` for each numeric entry of an eval record's ``metrics`` map (others are skipped)."""
    metrics = record.get("metrics")
    if not isinstance(metrics, dict):
        return {}
    return {
        EVAL_PREFIX + str(name): number for name, value in metrics.items() if (number := _finite(value)) is not None
    }
