"""``worker.algo.grpo.policy_loss`` against TRL 1.16's own ``GRPOTrainer._compute_loss``, option by option.

The reference is TRL itself, not a re-derivation: the loss menu is TRL's (its option names, defaults and
order of masks and weights), so the only check that cannot share a misreading with our code is to run
TRL's code on the same tensors and compare the loss and its gradient. The trainer is a bare instance
(``object.__new__``) with just the attributes ``_compute_loss`` reads, one process and no gradient
accumulation; its model forward is replaced by one that returns fixed log-probabilities and entropies.
The vLLM correction weight is computed by TRL in ``_generate_and_score_completions``, which needs a live
generator, so ``trl_correction_weight`` below restates that block's formula (TRL 1.16,
``grpo_trainer.py`` around line 2660) in the test only; our own path from ``sampling_logprobs`` must give
the same loss as passing that precomputed weight.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from worker.algo.grpo import LOSS_TYPES, policy_loss

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
CLIPPED = ("dapo", "grpo", "dr_grpo", "bnpo", "luspo")
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# (rows, width, seed): padding, an empty row, a single-token width, a single row, a long row.
SHAPES = [(6, 7, 0), (3, 1, 1), (1, 9, 2), (8, 16, 3)]
MAX_COMPLETION_LENGTH = 20


def make_tensors(rows: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def noise(scale: float) -> torch.Tensor:
        return torch.randn(rows, width, generator=generator, dtype=torch.float64) * scale

    behavior = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 3
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    lengths[0] = width
    if rows > 2:
        lengths[-1] = 0  # a sequence without completion tokens
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    sampling = behavior + noise(0.3)
    if rows > 2 and width > 2:
        sampling[1, 0] = float("nan")  # a token the generator could not score
    return {
        "logprobs": behavior + noise(0.4),
        "behavior": behavior,
        "sampling": sampling,
        "ref": behavior + noise(0.3),
        "entropy": torch.rand(rows, width, generator=generator, dtype=torch.float64) * 3,
        "advantages": torch.randn(rows, generator=generator, dtype=torch.float64),
        "mask": mask,
    }


def trl_correction_weight(
    old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, clip_min: float | None, clip_max: float
) -> torch.Tensor:
    """TRL's vLLM importance-sampling weight, as its ``_generate_and_score_completions`` computes it."""
    gap = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        gap = gap.sum(dim=-1, keepdim=True)
    ratio = torch.exp(gap)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def trl_sampling_metrics(
    old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor, per_sequence: bool
) -> dict[str, float]:
    """The ``sampling/*`` metrics TRL logs next to that weight."""
    gap = torch.abs(old - sampling)
    gap = gap[mask & ~torch.isnan(gap)]
    flat = weight.flatten() if per_sequence else weight[mask]

    def figure(values: torch.Tensor, reduce: Any) -> float:
        return reduce(values).item() if values.numel() else 0.0

    return {
        "sampling_logp_difference_mean": figure(gap, torch.mean),
        "sampling_logp_difference_max": figure(gap, torch.max),
        "is_ratio_min": figure(flat, torch.min),
        "is_ratio_mean": figure(flat, torch.mean),
        "is_ratio_max": figure(flat, torch.max),
    }


class OneProcess:
    """The accelerator calls ``_compute_loss`` makes, for a single process."""

    num_processes = 1

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        return tensor


def trl_loss(data: dict[str, torch.Tensor], options: dict[str, Any]) -> tuple[float, torch.Tensor, dict]:
    """TRL's loss, its gradient with respect to the log-probabilities and its logged metrics."""
    logprobs = data["logprobs"].clone().requires_grad_(True)
    rows, width = logprobs.shape
    mask = data["mask"].int()
    correction = options.get("vllm_importance_sampling_correction", False)
    args = SimpleNamespace(
        use_bias_correction_kl=options.get("use_bias_correction_kl", True),
        delta=options.get("delta"),
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=1,
    )
    trainer = object.__new__(GRPOTrainer)
    epsilon_low = options.get("epsilon_low", 0.2)
    high = options.get("epsilon_high")
    attributes = {
        "args": args,
        "loss_type": options.get("loss_type", "dapo"),
        "epsilon_low": epsilon_low,
        "epsilon_high": epsilon_low if high is None else high,
        "beta": options.get("beta", 0.0),
        "importance_sampling_level": options.get("importance_sampling_level", "token"),
        "top_entropy_quantile": options.get("top_entropy_quantile", 1.0),
        "off_policy_mask_threshold": options.get("off_policy_mask_threshold"),
        "use_vllm": correction,
        "vllm_importance_sampling_correction": correction,
        "max_completion_length": options.get("max_completion_length", MAX_COMPLETION_LENGTH),
        "aux_loss_enabled": False,
        "_entropy_bonus_enabled": False,
        "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)},
        "current_gradient_accumulation_steps": 1,
        "accelerator": OneProcess(),
        "model": SimpleNamespace(training=True),
        "_get_per_token_logps_and_entropies": lambda *args, **kwargs: (logprobs, data["entropy"], None),
    }
    for name, value in attributes.items():
        setattr(trainer, name, value)
    inputs = {
        "prompt_ids": torch.zeros(rows, 2, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 2, dtype=torch.int),
        "completion_ids": torch.zeros(rows, width, dtype=torch.long),
        "completion_mask": mask,
        "advantages": data["advantages"],
        "num_items_in_batch": mask.sum().float(),
        "old_per_token_logps": data["behavior"],
    }
    if options.get("with_sampling", False):
        inputs["sampling_per_token_logps"] = data["sampling"]
    if correction:
        inputs["importance_sampling_ratio"] = trl_correction_weight(
            data["behavior"],
            data["sampling"],
            mask,
            options["vllm_importance_sampling_mode"],
            options.get("vllm_importance_sampling_clip_min"),
            options.get("vllm_importance_sampling_clip_max", 3.0),
        )
    if options.get("beta", 0.0):
        inputs["ref_per_token_logps"] = data["ref"]
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.item(), logprobs.grad, {"metrics": metrics, "weight": inputs.get("importance_sampling_ratio")}


def our_loss(
    data: dict[str, torch.Tensor], options: dict[str, Any], **overrides: Any
) -> tuple[float, torch.Tensor, dict[str, float]]:
    logprobs = data["logprobs"].clone().requires_grad_(True)
    kwargs = {key: value for key, value in options.items() if key != "with_sampling"}
    kwargs.setdefault("max_completion_length", MAX_COMPLETION_LENGTH)
    if options.get("with_sampling", False) or options.get("vllm_importance_sampling_correction", False):
        kwargs["sampling_logprobs"] = data["sampling"]
    if options.get("beta", 0.0):
        kwargs["ref_logprobs"] = data["ref"]
    kwargs.update(overrides)
    loss, stats = policy_loss(
        logprobs, data["behavior"], data["advantages"], data["mask"], entropy=data["entropy"], **kwargs
    )
    loss.backward()
    return loss.item(), logprobs.grad, stats


def option_cases() -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = []
    for loss_type in LOSS_TYPES:
        cases.append((f"{loss_type}", {"loss_type": loss_type, "epsilon_high": 0.28}))
        cases.append((f"{loss_type}-sequence", {"loss_type": loss_type, "importance_sampling_level": "sequence"}))
        cases.append((f"{loss_type}-entropy", {"loss_type": loss_type, "top_entropy_quantile": 0.3}))
        cases.append((f"{loss_type}-opsm", {"loss_type": loss_type, "off_policy_mask_threshold": 0.05}))
        cases.append(
            (
                f"{loss_type}-opsm-sampling",
                {"loss_type": loss_type, "off_policy_mask_threshold": 0.05, "with_sampling": True},
            )
        )
        for bias in (True, False):
            options = {"loss_type": loss_type, "beta": 0.04, "use_bias_correction_kl": bias}
            cases.append((f"{loss_type}-beta-bias{bias}", options))
    cases.append(("cispo-cap5", {"loss_type": "cispo", "epsilon_high": 5.0}))
    cases.append(("cispo-cap1.2", {"loss_type": "cispo", "epsilon_high": 1.2}))
    for loss_type in CLIPPED:
        cases.append((f"{loss_type}-delta", {"loss_type": loss_type, "epsilon_high": 0.28, "delta": 1.4}))
    cases.append(("dapo-delta-sequence", {"loss_type": "dapo", "delta": 1.1, "importance_sampling_level": "sequence"}))
    cases.append(
        ("grpo-sequence-beta-bias", {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.1})
    )
    for loss_type in ("dapo", "grpo", "cispo", "sapo", "luspo", "vespo"):
        for mode in MODES:
            for clip_min in (None, 0.6):
                options = {
                    "loss_type": loss_type,
                    "vllm_importance_sampling_correction": True,
                    "vllm_importance_sampling_mode": mode,
                    "vllm_importance_sampling_clip_min": clip_min,
                    "vllm_importance_sampling_clip_max": 1.8 if mode.startswith("token") else 3.0,
                }
                cases.append((f"{loss_type}-{mode}-min{clip_min}", options))
    everything = {
        "epsilon_high": 0.28,
        "importance_sampling_level": "sequence",
        "off_policy_mask_threshold": 0.02,
        "top_entropy_quantile": 0.5,
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_min": 0.5,
        "beta": 0.05,
        "with_sampling": True,
    }
    for loss_type in LOSS_TYPES:
        cases.append((f"{loss_type}-everything", {"loss_type": loss_type, **everything}))
        token_level = {
            **everything,
            "loss_type": loss_type,
            "delta": 1.3,
            "importance_sampling_level": "token",
            "vllm_importance_sampling_mode": "sequence_mask",
        }
        cases.append((f"{loss_type}-everything-token", token_level))
    return cases


CASES = option_cases()


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{rows}x{width}" for rows, width, _ in SHAPES])
@pytest.mark.parametrize(("name", "options"), CASES, ids=[name for name, _ in CASES])
def test_loss_and_gradient_match_trl(name: str, options: dict[str, Any], shape: tuple[int, int, int]) -> None:
    data = make_tensors(*shape)
    expected_loss, expected_grad, trl = trl_loss(data, options)
    loss, grad, stats = our_loss(data, options)
    assert loss == pytest.approx(expected_loss, **{"rel": 1e-5, "abs": 1e-5})
    torch.testing.assert_close(grad, expected_grad, **TOLERANCE)

    if options.get("vllm_importance_sampling_correction", False):
        # The precomputed weight (TRL's) through our function: the same loss, gradient and weight figures.
        weight = trl["weight"]
        loss_given, grad_given, stats_given = our_loss(data, options, importance_sampling_ratio=weight)
        assert loss_given == pytest.approx(expected_loss, rel=1e-5, abs=1e-5)
        torch.testing.assert_close(grad_given, expected_grad, **TOLERANCE)
        per_sequence = options["vllm_importance_sampling_mode"].startswith("sequence")
        reference = trl_sampling_metrics(data["behavior"], data["sampling"], data["mask"], weight, per_sequence)
        for key, value in reference.items():
            assert stats[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
            if key.startswith("is_ratio"):
                assert stats_given[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key

    # TRL's own logged figures where ours mean the same (token-level weights: one value per token); TRL
    # averages the clip indicators in float32. At width 1 TRL's metric helper takes any (B, 1) tensor for
    # one value per sequence and averages it over all rows, padding included, so there it is no reference.
    if data["mask"].shape[1] == 1:
        return
    metrics = trl["metrics"]
    assert stats["entropy"] == pytest.approx(metrics["entropy"], rel=1e-6)
    if options.get("beta", 0.0):
        assert stats["kl_ref"] == pytest.approx(metrics["kl"], rel=1e-6, abs=1e-12)
    if options.get("importance_sampling_level", "token") == "token":
        if options.get("loss_type", "dapo") in CLIPPED:
            assert stats["clip_low"] == pytest.approx(metrics["clip_ratio/low_mean"], abs=1e-6)
            assert stats["clip_high"] == pytest.approx(metrics["clip_ratio/high_mean"], abs=1e-6)
            assert stats["clip_region"] == pytest.approx(metrics["clip_ratio/region_mean"], abs=1e-6)
        elif options.get("loss_type") == "cispo":
            assert stats["clip_high"] == pytest.approx(metrics["cispo_clip_ratio"], abs=1e-6)


def test_the_cases_exercise_the_options() -> None:
    """The random tensors make every mask and clip bite somewhere (else a match would prove little)."""
    data = make_tensors(8, 16, 3)
    _, _, stats = our_loss(data, {"off_policy_mask_threshold": 0.05, "with_sampling": True})
    assert 0 < stats["off_policy_masked"] < 1
    _, _, stats = our_loss(data, {"top_entropy_quantile": 0.3})
    assert 0.5 < stats["entropy_masked"] < 0.9
    _, _, stats = our_loss(data, {"epsilon_high": 0.28})
    assert stats["clip_low"] > 0 and stats["clip_high"] > 0
    for mode in MODES:
        options = {
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": mode,
            "vllm_importance_sampling_clip_min": 0.6,
            "vllm_importance_sampling_clip_max": 1.8 if mode.startswith("token") else 3.0,
        }
        _, _, stats = our_loss(data, options)
        if mode.endswith("mask"):
            assert stats["is_ratio_min"] == 0.0, mode  # some weights masked to 0
        else:
            assert stats["is_ratio_min"] == pytest.approx(0.6) and stats["is_ratio_max"] > 1.0, mode
    # delta changes the loss where A < 0 and the weight exceeds it.
    with_delta, _, _ = our_loss(data, {"epsilon_high": 0.28, "delta": 1.4})
    without, _, _ = our_loss(data, {"epsilon_high": 0.28})
    assert with_delta != pytest.approx(without)
