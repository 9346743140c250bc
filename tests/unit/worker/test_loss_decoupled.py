"""The decoupled objective (``loss.decoupled``, ``proximal_logprobs`` of worker/algo/grpo.py) against its formula.

The reference below is written out per token in plain torch, from the definition alone: the ratio to the
proximal policy ``r = exp(logp - prox)`` is clipped, the behavior weight ``b = exp(prox - beh)`` (no
gradient) multiplies the clipped surrogate, and a token with ``b`` above the cap gets weight 0 but still
counts in the denominators. TRL has no such loss, so there is no second implementation to compare with.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from asyncgrpo.run.config import LossConfig, RunConfig
from tests.support.train_samples import capture_gradients, synthetic_samples
from worker.algo.grpo import NonFiniteError, policy_loss
from worker.model.policy import Policy
from worker.optimize.trainer import Trainer

CLIPPED = ("dapo", "grpo", "dr_grpo", "bnpo", "luspo")
UNCLIPPED = ("cispo", "sapo", "vespo")
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28


def random_batch(seed: int, rows: int = 6, width: int = 7) -> dict[str, torch.Tensor]:
    """Unrelated behaviour, proximal and current logprobs (ratios well outside the clip range on both sides),
    padding with garbage in it, and one row without completion tokens."""
    generator = torch.Generator().manual_seed(seed)
    behavior = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 3
    proximal = behavior + torch.randn(rows, width, generator=generator, dtype=torch.float64) * 0.4
    current = proximal + torch.randn(rows, width, generator=generator, dtype=torch.float64) * 0.4
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    lengths[0], lengths[-1] = width, 0
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    for tensor in (behavior, proximal, current):
        tensor[~mask] = 7.0  # garbage at padding: must never count
    return {
        "logprobs": current,
        "behavior": behavior,
        "proximal": proximal,
        "advantages": torch.randn(rows, generator=generator, dtype=torch.float64),
        "mask": mask,
    }


def reference_loss(
    logprobs: torch.Tensor,
    proximal: torch.Tensor,
    behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    delta: float | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """The decoupled loss, one token at a time."""
    rows, width = logprobs.shape
    row_sums: list[torch.Tensor] = []
    counts: list[int] = []
    for i in range(rows):
        row_sum = logprobs.new_zeros(())
        count = 0
        for t in range(width):
            if not mask[i, t]:
                continue
            count += 1
            advantage = float(advantages[i])
            r = torch.exp(logprobs[i, t] - float(proximal[i, t]))
            b = math.exp(float(proximal[i, t]) - float(behavior[i, t]))
            unclipped = torch.clamp(r, max=delta) if delta is not None else r
            clipped = torch.clamp(r, 1.0 - EPSILON_LOW, 1.0 + EPSILON_HIGH)
            surrogate = -torch.minimum(unclipped * advantage, clipped * advantage)
            weight = 0.0 if cap is not None and b > cap else b
            row_sum = row_sum + surrogate * weight
        row_sums.append(row_sum)
        counts.append(count)
    if aggregation == "dapo":  # token sum / tokens
        return sum(row_sums) / sum(counts)
    if aggregation == "grpo":  # mean over sequences of each sequence's token mean
        return sum(s / max(c, 1) for s, c in zip(row_sums, counts, strict=True)) / rows
    raise AssertionError(aggregation)


def decoupled_call(
    batch: dict[str, torch.Tensor], loss_type: str, **options: object
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    logprobs = batch["logprobs"].clone().requires_grad_(True)
    loss, stats = policy_loss(
        logprobs,
        batch["behavior"],
        batch["advantages"],
        batch["mask"],
        proximal_logprobs=batch["proximal"],
        loss_type=loss_type,  # type: ignore[arg-type]
        epsilon_low=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        **options,  # type: ignore[arg-type]
    )
    loss.backward()
    assert logprobs.grad is not None
    return loss, stats, logprobs.grad


# --- (a) the loss and its gradient are the formula ------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["dapo", "grpo"])
@pytest.mark.parametrize(("delta", "cap"), [(None, None), (None, 1.3), (1.5, None), (1.5, 1.3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_are_the_formula(aggregation: str, delta: float | None, cap: float | None, seed: int) -> None:
    batch = random_batch(seed)
    loss, _, gradient = decoupled_call(batch, aggregation, delta=delta, behavior_weight_cap=cap)

    logprobs = batch["logprobs"].clone().requires_grad_(True)
    expected = reference_loss(
        logprobs, batch["proximal"], batch["behavior"], batch["advantages"], batch["mask"], aggregation, delta, cap
    )
    expected.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gradient, logprobs.grad, rtol=1e-12, atol=1e-12)


def test_the_random_batches_reach_every_branch() -> None:
    # The formula test means something only if its batches clip on both sides, cap some tokens and delta-cap
    # some ratios: otherwise a wrong clip, cap or delta would go unnoticed.
    clipped_low = clipped_high = capped = delta_capped = 0
    for seed in (0, 1, 2):
        batch = random_batch(seed)
        mask, advantages = batch["mask"], batch["advantages"].unsqueeze(1)
        r = torch.exp(batch["logprobs"] - batch["proximal"])
        b = torch.exp(batch["proximal"] - batch["behavior"])
        clipped_low += int(((r < 1 - EPSILON_LOW) & (advantages < 0) & mask).sum())
        clipped_high += int(((r > 1 + EPSILON_HIGH) & (advantages > 0) & mask).sum())
        capped += int(((b > 1.3) & mask).sum())
        delta_capped += int(((r > 1.5) & (advantages < 0) & mask).sum())
    assert min(clipped_low, clipped_high, capped, delta_capped) > 0


def test_stats_are_of_the_proximal_ratio_and_the_behavior_weight() -> None:
    batch = random_batch(3)
    _, stats, _ = decoupled_call(batch, "dapo", behavior_weight_cap=1.3)
    mask, advantages = batch["mask"], batch["advantages"].unsqueeze(1)
    r = torch.exp(batch["logprobs"] - batch["proximal"])[mask]
    b = torch.exp(batch["proximal"] - batch["behavior"])[mask]
    low = ((torch.exp(batch["logprobs"] - batch["proximal"]) < 1 - EPSILON_LOW) & (advantages < 0))[mask]
    assert stats["ratio"] == pytest.approx(float(r.mean()))
    assert stats["clip_low"] == pytest.approx(float(low.double().mean()))
    assert stats["behavior_weight_mean"] == pytest.approx(float(b.mean()))
    assert stats["behavior_weight_masked"] == pytest.approx(float((b > 1.3).double().mean()))
    assert 0 < stats["behavior_weight_masked"] < 1
    _, uncapped, _ = decoupled_call(batch, "dapo")
    assert uncapped["behavior_weight_masked"] == 0.0
    assert uncapped["behavior_weight_mean"] == pytest.approx(stats["behavior_weight_mean"])
    # The plain loss has neither figure, and its ratio is the one to the behaviour policy.
    _, plain = policy_loss(batch["logprobs"], batch["behavior"], batch["advantages"], mask)
    assert "behavior_weight_mean" not in plain and "behavior_weight_masked" not in plain
    assert plain["ratio"] == pytest.approx(float(torch.exp(batch["logprobs"] - batch["behavior"])[mask].mean()))


# --- (b) with the proximal policy the behaviour policy, it is the plain loss -------------------------------


@pytest.mark.parametrize("loss_type", CLIPPED)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("delta", [None, 1.5])
def test_proximal_equal_to_behavior_is_the_plain_loss(loss_type: str, level: str, delta: float | None) -> None:
    batch = random_batch(4)
    batch["proximal"] = batch["behavior"].clone()
    options = {"importance_sampling_level": level, "delta": delta, "max_completion_length": 9}
    loss, stats, gradient = decoupled_call(batch, loss_type, **options)

    logprobs = batch["logprobs"].clone().requires_grad_(True)
    plain, plain_stats = policy_loss(
        logprobs,
        batch["behavior"],
        batch["advantages"],
        batch["mask"],
        loss_type=loss_type,  # type: ignore[arg-type]
        epsilon_low=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        **options,  # type: ignore[arg-type]
    )
    plain.backward()
    assert logprobs.grad is not None and logprobs.grad.abs().sum() > 0
    torch.testing.assert_close(loss, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gradient, logprobs.grad, rtol=1e-12, atol=1e-12)
    for name in ("ratio", "kl", "clip_low", "clip_high", "clip_region"):
        assert stats[name] == pytest.approx(plain_stats[name], abs=1e-12), name
    assert stats["behavior_weight_mean"] == pytest.approx(1.0)


def test_a_different_proximal_policy_is_not_the_plain_loss() -> None:
    # The counterpart of the test above: the decoupled loss does depend on the proximal logprobs.
    batch = random_batch(4)
    loss, _, _ = decoupled_call(batch, "dapo")
    plain, _ = policy_loss(batch["logprobs"], batch["behavior"], batch["advantages"], batch["mask"])
    assert abs(loss.item() - plain.item()) > 1e-3


# --- (c) a token above the cap has no gradient ------------------------------------------------------------


def test_a_token_above_the_cap_contributes_no_gradient() -> None:
    batch = random_batch(5)
    cap = 1.3
    _, _, gradient = decoupled_call(batch, "dapo", behavior_weight_cap=cap)
    _, _, uncapped = decoupled_call(batch, "dapo")
    b = torch.exp(batch["proximal"] - batch["behavior"])
    above = (b > cap) & batch["mask"]
    assert above.any()
    assert torch.equal(gradient[above], torch.zeros_like(gradient[above]))
    # Without the cap the same tokens do carry a gradient (some of them: the others are clipped).
    assert uncapped[above].abs().sum() > 0
    # The cap changes nothing else: the normalisers still count the dropped tokens.
    torch.testing.assert_close(gradient[~above], uncapped[~above], rtol=0, atol=0)


def test_an_overflowing_behavior_weight_above_the_cap_stays_finite() -> None:
    # b = exp(1000) is inf in float64: a capped token must drop out without a NaN in the loss or the gradient.
    batch = random_batch(6)
    batch["proximal"][0, 0] = batch["behavior"][0, 0] + 1000.0
    batch["logprobs"][0, 0] = batch["proximal"][0, 0]
    loss, stats, gradient = decoupled_call(batch, "grpo", behavior_weight_cap=2.0)
    assert torch.isfinite(loss) and torch.isfinite(gradient).all()
    assert gradient[0, 0] == 0.0 and stats["behavior_weight_masked"] > 0
    with pytest.raises(NonFiniteError, match="loss"):
        decoupled_call(batch, "grpo")  # uncapped, that weight is infinite


# --- refusals: policy_loss and (d) the run config ---------------------------------------------------------


@pytest.mark.parametrize("loss_type", UNCLIPPED)
def test_the_loss_refuses_decoupled_for_the_unclipped_types(loss_type: str) -> None:
    with pytest.raises(ValueError, match=rf"proximal_logprobs.*loss_type='{loss_type}'"):
        decoupled_call(random_batch(0), loss_type)


def test_the_loss_refuses_a_bad_cap_and_bad_proximal_logprobs() -> None:
    batch = random_batch(0)
    with pytest.raises(ValueError, match=r"behavior_weight_cap=2\.0.*proximal_logprobs"):
        policy_loss(batch["logprobs"], batch["behavior"], batch["advantages"], batch["mask"], behavior_weight_cap=2.0)
    with pytest.raises(ValueError, match=r"behavior_weight_cap=1\.0"):
        decoupled_call(batch, "dapo", behavior_weight_cap=1.0)
    with pytest.raises(ValueError, match="proximal_logprobs has shape"):
        decoupled_call({**batch, "proximal": batch["proximal"][:, :3]}, "dapo")
    poisoned = batch["proximal"].clone()
    poisoned[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="proximal_logprobs"):
        decoupled_call({**batch, "proximal": poisoned}, "dapo")


@pytest.mark.parametrize("loss_type", UNCLIPPED)
def test_the_config_refuses_decoupled_for_the_unclipped_types(loss_type: str) -> None:
    # vespo takes only a per-token correction weight: set one, so that decoupled is the only thing refused.
    mode = {"vllm_importance_sampling_mode": "token_mask"} if loss_type == "vespo" else {}
    with pytest.raises(ValueError, match=rf"loss\.decoupled.*loss\.loss_type='{loss_type}'.*dapo"):
        LossConfig(loss_type=loss_type, decoupled=True, **mode)
    assert not LossConfig(loss_type=loss_type, **mode).decoupled  # the type alone is fine


def test_the_config_refuses_a_cap_without_decoupled() -> None:
    with pytest.raises(ValueError, match=r"loss\.behavior_weight_cap=5\.0.*loss\.decoupled"):
        LossConfig(behavior_weight_cap=5.0)
    for bad in (1.0, 0.5, 101.0):
        with pytest.raises(ValueError, match="behavior_weight_cap"):
            LossConfig(decoupled=True, behavior_weight_cap=bad)


@pytest.mark.parametrize("loss_type", CLIPPED)
def test_the_config_takes_decoupled_for_the_clipped_types(loss_type: str) -> None:
    loss = LossConfig(loss_type=loss_type, decoupled=True, behavior_weight_cap=5.0)
    assert loss.decoupled and loss.behavior_weight_cap == 5.0
    assert LossConfig().decoupled is False and LossConfig().behavior_weight_cap is None


# --- (e) the trainer applies it ---------------------------------------------------------------------------


def _stale_step_gradients(tiny_model_dir: Path, loss: dict[str, object]) -> tuple[float, dict[str, torch.Tensor]]:
    """One update's loss and gradients on samples whose behaviour logprobs are not the current policy's."""
    config = RunConfig.model_validate({"loss": loss, "optimizer": {"max_grad_norm": 1e6}})
    trainer = Trainer.initial(Policy.load(str(tiny_model_dir)), config)
    samples = synthetic_samples(trainer, 12, seed=11)
    rng = random.Random(11)
    for sample in samples:  # as if sampled by an older version
        sample.behavior_logprobs = [value + rng.uniform(-0.6, 0.6) for value in sample.behavior_logprobs]
    gradients = capture_gradients(trainer)
    metrics = trainer.step(samples)
    return metrics.loss, gradients


@pytest.mark.usefixtures("one_torch_thread")
def test_a_decoupled_trainer_step_weighs_instead_of_clipping(tiny_model_dir: Path) -> None:
    plain_loss, plain = _stale_step_gradients(tiny_model_dir, {})
    decoupled_loss, decoupled = _stale_step_gradients(tiny_model_dir, {"decoupled": True})
    _, capped = _stale_step_gradients(tiny_model_dir, {"decoupled": True, "behavior_weight_cap": 1.2})
    # With the proximal policy this very forward, r = 1 and b = exp(logp - beh): the gradient is the
    # unclipped surrogate's, i.e. a plain step whose clip range holds every ratio.
    _, unclipped = _stale_step_gradients(tiny_model_dir, {"epsilon_low": 1.0, "epsilon_high": 100.0})
    scale = max(float(g.abs().max()) for g in plain.values())
    assert scale > 0

    def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[name] - b[name]).abs().max()) for name in a) / scale

    assert distance(decoupled, plain) > 1e-2  # the plain step clipped the stale tokens
    assert distance(decoupled, capped) > 1e-2  # the cap reached the loss
    for name, gradient in unclipped.items():
        torch.testing.assert_close(decoupled[name], gradient, rtol=1e-4, atol=1e-6 * scale)
    assert decoupled_loss != pytest.approx(plain_loss)
