"""Advantages of a generate task's completions from their rewards: TRL's ``scale_rewards`` and
``multi_objective_aggregation`` (the definitions of ``GRPOTrainer._generate_and_score_completions``).

The inputs are one row per completion, one column per reward (raw values), completions in groups of
``group_size`` consecutive rows. Standard deviations are the sample ones (Bessel-corrected, as TRL's), and
``eps = 1e-4`` keeps a group whose rewards are all equal at advantage 0.

* ``sum_then_normalize`` (the default): the weighted sum of the rewards, minus its group mean, divided by the
  std of its group (``scale_rewards="group"``), of the whole task (``"batch"``), or not divided (``"none"``,
  Dr. GRPO).
* ``normalize_then_sum`` (GDPO): each reward normalised within its group first, so a reward on a large scale
  cannot drown the others; the weighted sum of those, then normalised over the whole task. ``scale_rewards``
  does not apply.

"The whole task" is TRL's generation batch: here the groups one generate task scored together, so a task of
one group makes ``"batch"`` equal ``"group"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from worker.algo.grpo import NonFiniteError

ADVANTAGE_EPS = 1e-4
ScaleRewards = Literal["group", "batch", "none"]
Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]


def group_advantages(
    rewards: Sequence[float] | torch.Tensor,
    group_size: int,
    *,
    scale: bool = True,
    eps: float = ADVANTAGE_EPS,
) -> torch.Tensor:
    """Advantages of consecutive groups of ``group_size`` rewards: ``(r - mean) / (std + eps)``.

    ``std`` is the sample standard deviation (``n - 1`` in the denominator); ``scale=False`` skips the
    division. A group whose rewards are all equal gets advantages of exactly 0. Returns float32, shape (N,).
    """
    values = torch.as_tensor(rewards, dtype=torch.float32).detach().reshape(-1)
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group needs at least 2 samples to have an advantage")
    if values.numel() == 0 or values.numel() % group_size:
        raise ValueError(f"{values.numel()} rewards do not split into groups of {group_size}; pass whole groups")
    if not torch.isfinite(values).all():
        bad = torch.nonzero(~torch.isfinite(values)).flatten().tolist()
        raise NonFiniteError(f"rewards at positions {bad} are not finite; fix the reward function")
    grouped = values.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def _std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # Bessel's correction; one value has no spread (0, not NaN: its advantage is 0 either way).
    count = values.numel() if dim is None else values.shape[dim]
    if count < 2:
        return torch.zeros_like(values.mean() if dim is None else values.mean(dim=dim, keepdim=True))
    return values.std() if dim is None else values.std(dim=dim, keepdim=True)


def task_advantages(
    rewards: Sequence[Sequence[float]] | torch.Tensor,
    weights: Sequence[float],
    group_size: int,
    *,
    scale_rewards: ScaleRewards = "group",
    aggregation: Aggregation = "sum_then_normalize",
    eps: float = ADVANTAGE_EPS,
) -> list[float]:
    """One advantage per completion (row of ``rewards``); ``weights`` has one entry per reward column."""
    table = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1, len(weights))
    rows = table.shape[0]
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group needs at least 2 samples to have an advantage")
    if rows == 0 or rows % group_size:
        raise ValueError(f"{rows} completions do not split into groups of {group_size}; pass whole groups")
    if not torch.isfinite(table).all():
        raise ValueError("rewards hold NaN or infinite values; score them before computing advantages")
    weight = torch.as_tensor(list(weights), dtype=torch.float32)
    if aggregation == "sum_then_normalize":
        totals = (table * weight).sum(dim=1)
        grouped = totals.view(-1, group_size)
        centered = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
        if scale_rewards == "group":
            spread = _std(grouped, dim=1).expand_as(grouped).reshape(-1)
        elif scale_rewards == "batch":
            spread = _std(totals).expand_as(totals)
        elif scale_rewards == "none":
            return centered.tolist()
        else:
            raise ValueError(f"scale_rewards={scale_rewards!r} is unknown; use 'group', 'batch' or 'none'")
        return (centered / (spread + eps)).tolist()
    if aggregation == "normalize_then_sum":
        grouped = table.view(-1, group_size, len(weights))
        normalised = (grouped - grouped.mean(dim=1, keepdim=True)) / (_std(grouped, dim=1) + eps)
        totals = (normalised.reshape(-1, len(weights)) * weight).sum(dim=1)
        return ((totals - totals.mean()) / (_std(totals) + eps)).tolist()
    raise ValueError(
        f"multi_objective_aggregation={aggregation!r} is unknown; use 'sum_then_normalize' or 'normalize_then_sum'"
    )
