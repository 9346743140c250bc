"""Advantages from rewards: TRL's scale_rewards modes and multi-objective aggregations, by hand."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from worker.algo.advantages import ADVANTAGE_EPS, group_advantages, task_advantages
from worker.algo.grpo import NonFiniteError

# Two groups of 3 completions, two rewards each: (correctness, length bonus on a larger scale).
TABLE = [[1.0, 10.0], [0.0, 30.0], [0.0, 20.0], [1.0, 40.0], [1.0, 0.0], [0.0, 20.0]]
WEIGHTS = [2.0, 0.5]
TOTALS = [2.0 * a + 0.5 * b for a, b in TABLE]


def _group(values: list[float], size: int) -> list[list[float]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


def test_group_scaling_is_the_single_reward_definition() -> None:
    got = task_advantages(TABLE, WEIGHTS, 3)
    assert got == pytest.approx(group_advantages(TOTALS, 3).tolist(), abs=1e-6)
    expected = []
    for group in _group(TOTALS, 3):
        mean, std = statistics.mean(group), statistics.stdev(group)
        expected += [(value - mean) / (std + ADVANTAGE_EPS) for value in group]
    assert got == pytest.approx(expected, abs=1e-5)


def test_batch_scaling_divides_by_the_whole_tasks_std() -> None:
    got = task_advantages(TABLE, WEIGHTS, 3, scale_rewards="batch")
    std = statistics.stdev(TOTALS)
    expected = [value - statistics.mean(group) for group in _group(TOTALS, 3) for value in group]
    assert got == pytest.approx([value / (std + ADVANTAGE_EPS) for value in expected], abs=1e-5)


def test_no_scaling_centres_only() -> None:
    got = task_advantages(TABLE, WEIGHTS, 3, scale_rewards="none")
    assert got == pytest.approx([v - statistics.mean(g) for g in _group(TOTALS, 3) for v in g], abs=1e-5)


def test_normalize_then_sum_normalises_each_reward_in_its_group_then_the_sum_over_the_task() -> None:
    got = task_advantages(TABLE, WEIGHTS, 3, aggregation="normalize_then_sum")
    columns = list(zip(*TABLE, strict=True))
    normalised = []
    for column in columns:
        values = []
        for group in _group(list(column), 3):
            mean, std = statistics.mean(group), statistics.stdev(group)
            values += [(value - mean) / (std + ADVANTAGE_EPS) for value in group]
        normalised.append(values)
    summed = [sum(w * column[i] for w, column in zip(WEIGHTS, normalised, strict=True)) for i in range(len(TABLE))]
    mean, std = statistics.mean(summed), statistics.stdev(summed)
    assert got == pytest.approx([(value - mean) / (std + ADVANTAGE_EPS) for value in summed], abs=1e-5)
    # The point of it: the large-scale reward no longer decides the sign alone. Completion 1 (wrong, long) beats
    # completion 0 (right, short) under sum_then_normalize; normalised per reward it does not.
    assert task_advantages(TABLE, WEIGHTS, 3)[1] > task_advantages(TABLE, WEIGHTS, 3)[0]
    assert got[0] > got[1]


def test_equal_rewards_give_zero_advantages_in_every_mode() -> None:
    flat = [[1.0, 2.0]] * 4
    for options in ({}, {"scale_rewards": "batch"}, {"scale_rewards": "none"}, {"aggregation": "normalize_then_sum"}):
        assert task_advantages(flat, [1.0, 1.0], 2, **options) == [0.0] * 4


def test_bad_input_names_what_to_change() -> None:
    with pytest.raises(ValueError, match="scale_rewards='mean' is unknown"):
        task_advantages(TABLE, WEIGHTS, 3, scale_rewards="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multi_objective_aggregation='sum' is unknown"):
        task_advantages(TABLE, WEIGHTS, 3, aggregation="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="groups of 4"):
        task_advantages(TABLE, WEIGHTS, 4)
    with pytest.raises(ValueError, match="NaN or infinite"):
        task_advantages([[float("nan"), 1.0], [0.0, 1.0]], WEIGHTS, 2)


def test_matches_trl_reference_formula() -> None:
    """TRL computes both aggregations with its nanstd (sample std) and eps 1e-4; same numbers here."""
    from trl.trainer.utils import nanstd  # trl is a test-only dependency (the dev extra)

    rewards = torch.tensor(TABLE)
    weights = torch.tensor(WEIGHTS)
    totals = (rewards * weights).sum(dim=1)
    mean = totals.view(-1, 3).mean(dim=1).repeat_interleave(3)
    for mode in ("group", "batch"):
        std = nanstd(totals.view(-1, 3), dim=1).repeat_interleave(3) if mode == "group" else nanstd(totals)
        expected = (totals - mean) / (std + 1e-4)
        assert task_advantages(TABLE, WEIGHTS, 3, scale_rewards=mode) == pytest.approx(expected.tolist(), abs=1e-5)
    grouped = rewards.view(-1, 3, 2)
    per_reward = (grouped - grouped.mean(dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    summed = (per_reward.view(-1, 2) * weights).sum(dim=1)
    expected = (summed - summed.mean()) / (nanstd(summed) + 1e-4)
    got = task_advantages(TABLE, WEIGHTS, 3, aggregation="normalize_then_sum")
    assert got == pytest.approx(expected.tolist(), abs=1e-5)


def test_group_advantages_hand_values() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    # Group 1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 2: all equal -> 0.
    scaled = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = [scaled, -scaled, -scaled, scaled, 0.0, 0.0, 0.0, 0.0]
    assert group_advantages(rewards, 4).tolist() == pytest.approx(expected, rel=1e-6)
    unscaled = group_advantages(rewards, 4, scale=False).tolist()
    assert unscaled == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])


def test_group_advantages_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_advantages([1.0, 2.0, 3.0, 4.0], 3)
    with pytest.raises(ValueError, match="at least 2 samples"):
        group_advantages([1.0], 1)
    with pytest.raises(NonFiniteError, match=r"positions \[1\]"):
        group_advantages([1.0, float("nan")], 2)
