"""The GRPO math of worker/algo/grpo.py: hand-computed values, a naive reference loop, gradients, masks.

The match with TRL's own loss, option by option, is in test_loss_trl.py; this module holds the properties
TRL cannot show: micro-batch split invariance, padding that never leaks, option validation.
"""

from __future__ import annotations

import math

import pytest
import torch

from worker.algo.grpo import LOSS_TYPES, VLLM_IMPORTANCE_SAMPLING_MODES, NonFiniteError, policy_loss

CLASSIC = ("dapo", "grpo", "dr_grpo", "bnpo")  # the clipped-surrogate types the hand values and naive loop cover

# --- a hand-worked batch -----------------------------------------------------------------------------------
# Row 0: advantage +1, three tokens; row 1: advantage -2, two tokens and one padding position (garbage there).
LOGPROBS = [[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]]
BEHAVIOR = [[-1.0, -1.5, -0.5], [-1.0, -0.2, 9.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADVANTAGES = [1.0, -2.0]
E_HALF = math.exp(-0.5)  # 0.6065306597: the ratio of the two tokens whose logprob moved by -0.5
# Per-token losses -min(r*A, clip(r, 0.8, 1.28)*A):
#   row 0 (A=+1): r = 1, e^-0.5, 1          -> -1, -e^-0.5 (unclipped: r < 0.8 but A > 0), -1
#   row 1 (A=-2): r = e^-0.5, 1             -> -min(-2e^-0.5, -1.6) = 1.6 (clipped low), 2
ROW0 = -1.0 - E_HALF - 1.0  # -2.6065306597
ROW1 = 1.6 + 2.0  # 3.6
TOTAL = ROW0 + ROW1  # 0.9934693403
HAND_LOSS = {
    "grpo": (ROW0 / 3 + ROW1 / 2) / 2,  # mean of per-sequence token means = 0.4655782...
    "bnpo": TOTAL / 5,  # token mean = 0.1986938...
    "dr_grpo": TOTAL / (2 * 4),  # with max_completion_length = 4: 0.1241836...
    "dapo": TOTAL / 5,  # the step is this one micro-batch: 5 tokens
}


def hand_batch(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    return {
        "logprobs": torch.tensor(LOGPROBS, dtype=dtype),
        "behavior_logprobs": torch.tensor(BEHAVIOR, dtype=dtype),
        "advantages": torch.tensor(ADVANTAGES, dtype=dtype),
        "mask": torch.tensor(MASK, dtype=torch.bool),
    }


@pytest.mark.parametrize("loss_type", CLASSIC)
def test_hand_computed_loss(loss_type: str) -> None:
    loss, _ = policy_loss(
        **hand_batch(), loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, max_completion_length=4
    )
    assert loss.item() == pytest.approx(HAND_LOSS[loss_type], abs=1e-9)


def test_hand_computed_stats() -> None:
    _, stats = policy_loss(**hand_batch(), epsilon_low=0.2, epsilon_high=0.28)
    assert stats["tokens"] == 5
    assert stats["ratio"] == pytest.approx((3 + 2 * E_HALF) / 5)
    # k3 of the behaviour policy: exp(d) - d - 1 with d = beh - logp = 0.5 on two tokens, 0 elsewhere.
    assert stats["kl"] == pytest.approx(2 * (math.exp(0.5) - 1.5) / 5)
    assert stats["clip_low"] == pytest.approx(1 / 5)
    assert stats["clip_high"] == 0.0
    assert stats["clip_region"] == pytest.approx(1 / 5)
    assert "entropy" not in stats and "kl_ref" not in stats


def test_dapo_normalises_by_the_step_token_count() -> None:
    loss, _ = policy_loss(**hand_batch(), loss_type="dapo", epsilon_high=0.28, step_tokens=10)
    assert loss.item() == pytest.approx(TOTAL / 10, abs=1e-9)


def test_high_clip_and_symmetric_default() -> None:
    # One token, r = e^0.5 = 1.6487 with A = +1: clipped to 1 + epsilon_high.
    batch = {
        "logprobs": torch.tensor([[0.0]], dtype=torch.float64),
        "behavior_logprobs": torch.tensor([[-0.5]], dtype=torch.float64),
        "advantages": torch.tensor([1.0], dtype=torch.float64),
        "mask": torch.tensor([[1]]),
    }
    loss, stats = policy_loss(**batch, epsilon_low=0.2, epsilon_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    assert stats["clip_high"] == 1.0 and stats["clip_low"] == 0.0 and stats["clip_region"] == 1.0
    loss, _ = policy_loss(**batch, epsilon_low=0.2)  # epsilon_high=None: the same as epsilon_low
    assert loss.item() == pytest.approx(-1.2)


def test_kl_to_reference_is_added_with_beta() -> None:
    ref = torch.tensor([[-1.0, -2.0, -1.5], [-1.5, -0.2, 0.0]], dtype=torch.float64)
    # Only row 0 token 2 differs: ref - logp = -1 -> k3 = e^-1 + 1 - 1 = e^-1.
    loss, stats = policy_loss(**hand_batch(), loss_type="bnpo", epsilon_high=0.28, ref_logprobs=ref, beta=0.1)
    assert loss.item() == pytest.approx((TOTAL + 0.1 * math.exp(-1)) / 5, abs=1e-9)
    assert stats["kl_ref"] == pytest.approx(math.exp(-1) / 5)


def test_entropy_from_logits() -> None:
    batch = hand_batch()
    logits = torch.zeros(2, 3, 4, dtype=torch.float64)  # uniform over 4 tokens: entropy ln 4
    logits[1, 2] = torch.tensor([100.0, 0.0, 0.0, 0.0])  # padding position: must not count
    _, stats = policy_loss(**batch, logits=logits)
    assert stats["entropy"] == pytest.approx(math.log(4))


# --- against a naive per-token loop ------------------------------------------------------------------------


def naive_loss(lp, beh, adv, mask, loss_type, eps_low, eps_high, max_len, ref=None, beta=0.0, bias=True) -> float:
    """The definitions, one token at a time in plain Python (``bias``: the KL term times the ratio)."""
    per_seq_sums, per_seq_counts = [], []
    for i in range(len(lp)):
        total, count = 0.0, 0
        for t in range(len(lp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(lp[i][t] - beh[i][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            value = -min(ratio * adv[i], clipped * adv[i])
            if beta:
                d = ref[i][t] - lp[i][t]
                value += beta * (math.exp(d) - d - 1) * (ratio if bias else 1.0)
            total += value
            count += 1
        per_seq_sums.append(total)
        per_seq_counts.append(count)
    tokens = sum(per_seq_counts)
    if loss_type == "grpo":
        return sum(s / max(c, 1) for s, c in zip(per_seq_sums, per_seq_counts, strict=True)) / len(lp)
    if loss_type == "dr_grpo":
        return sum(per_seq_sums) / (len(lp) * max_len)
    return sum(per_seq_sums) / tokens  # bnpo and dapo agree for a single micro-batch


def random_batch(seed: int, rows: int = 6, width: int = 7) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    behavior = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 3
    logprobs = behavior + torch.randn(rows, width, generator=generator, dtype=torch.float64) * 0.4
    lengths = torch.randint(0, width + 1, (rows,), generator=generator)
    lengths[0] = width  # at least one full row
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    advantages = torch.randn(rows, generator=generator, dtype=torch.float64)
    return {"logprobs": logprobs, "behavior_logprobs": behavior, "advantages": advantages, "mask": mask}


@pytest.mark.parametrize("loss_type", CLASSIC)
@pytest.mark.parametrize(("seed", "bias"), [(0, True), (1, True), (2, True), (2, False)])
def test_vectorised_matches_naive_loop(loss_type: str, seed: int, bias: bool) -> None:
    batch = random_batch(seed)
    ref = batch["logprobs"] + 0.3
    beta = 0.05 if seed == 2 else 0.0
    loss, _ = policy_loss(
        **batch,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        max_completion_length=9,
        ref_logprobs=ref if beta else None,
        beta=beta,
        use_bias_correction_kl=bias,
    )
    expected = naive_loss(
        batch["logprobs"].tolist(),
        batch["behavior_logprobs"].tolist(),
        batch["advantages"].tolist(),
        batch["mask"].tolist(),
        loss_type,
        0.2,
        0.28,
        9,
        ref.tolist(),
        beta,
        bias,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


# --- gradients ---------------------------------------------------------------------------------------------


# cispo and vespo are left out: their weights are held constant in the gradient on purpose (see below).
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo", "sapo", "luspo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_finite_difference_gradient(loss_type: str, level: str) -> None:
    batch = random_batch(3)
    logprobs = batch.pop("logprobs").clone().requires_grad_(True)
    ref = batch["behavior_logprobs"] - 0.2

    def loss_of(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            lp,
            **batch,
            loss_type=loss_type,
            epsilon_high=0.28,
            max_completion_length=8,
            importance_sampling_level=level,
            ref_logprobs=ref,
            beta=0.1,
        )[0]

    assert torch.autograd.gradcheck(loss_of, (logprobs,), eps=1e-6, atol=1e-7)


def test_clipped_tokens_carry_no_gradient() -> None:
    batch = hand_batch()
    logprobs = batch.pop("logprobs").requires_grad_(True)
    loss, _ = policy_loss(logprobs, **batch, loss_type="bnpo", epsilon_high=0.28)
    loss.backward()
    assert logprobs.grad[1, 0].item() == 0.0  # clipped low with A < 0: min picks the constant
    assert logprobs.grad[0, 1].item() == pytest.approx(-E_HALF / 5)  # d(-r*A)/dlogp = -r*A, over 5 tokens


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batch_accumulation_equals_whole_batch(loss_type: str) -> None:
    batch = random_batch(4, rows=7)
    options = {"loss_type": loss_type, "epsilon_high": 0.28, "max_completion_length": 7}
    whole = batch["logprobs"].clone().requires_grad_(True)
    loss, _ = policy_loss(whole, batch["behavior_logprobs"], batch["advantages"], batch["mask"], **options)
    loss.backward()

    split = batch["logprobs"].clone().requires_grad_(True)
    step_tokens, step_sequences = int(batch["mask"].sum()), 7
    accumulated = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7)):
        part, _ = policy_loss(
            split[rows],
            batch["behavior_logprobs"][rows],
            batch["advantages"][rows],
            batch["mask"][rows],
            step_tokens=step_tokens,
            step_sequences=step_sequences,
            micro_batches=3,
            **options,
        )
        part.backward()
        accumulated += part.item()
    assert accumulated == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-12, atol=1e-15)


def test_bnpo_is_the_mean_of_micro_batch_token_means() -> None:
    batch = random_batch(5, rows=4)
    accumulated, expected = 0.0, 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        part = {key: value[rows] for key, value in batch.items()}
        loss, _ = policy_loss(**part, loss_type="bnpo", micro_batches=2)
        accumulated += loss.item()
        lists = [part[key].tolist() for key in ("logprobs", "behavior_logprobs", "advantages", "mask")]
        expected += naive_loss(*lists, "bnpo", 0.2, 0.2, 0) / 2
    assert accumulated == pytest.approx(expected, rel=1e-10)
    whole, _ = policy_loss(**batch, loss_type="bnpo")
    assert whole.item() != pytest.approx(accumulated)  # bnpo depends on the split, unlike dapo


# --- masks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padding_never_counts(loss_type: str) -> None:
    batch = random_batch(6)
    padding = ~batch["mask"]
    assert padding.any()
    clean = batch["logprobs"].clone().requires_grad_(True)
    loss_a, stats_a = policy_loss(
        clean, batch["behavior_logprobs"], batch["advantages"], batch["mask"], loss_type=loss_type
    )
    loss_a.backward()

    dirty_lp = batch["logprobs"].clone()
    dirty_lp[padding] = float("nan")
    dirty_beh = batch["behavior_logprobs"].clone()
    dirty_beh[padding] = 1e6
    dirty = dirty_lp.requires_grad_(True)
    loss_b, stats_b = policy_loss(dirty, dirty_beh, batch["advantages"], batch["mask"], loss_type=loss_type)
    loss_b.backward()

    assert loss_b.item() == loss_a.item()
    assert stats_b == stats_a
    assert torch.equal(dirty.grad, clean.grad)
    assert (clean.grad[padding] == 0).all()


def test_float_mask_is_accepted_and_checked() -> None:
    batch = hand_batch()
    loss_bool, _ = policy_loss(**batch)
    batch["mask"] = batch["mask"].double()
    loss_float, _ = policy_loss(**batch)
    assert loss_float.item() == loss_bool.item()
    batch["mask"] = batch["mask"] * 0.5
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        policy_loss(**batch)


# --- bad input ---------------------------------------------------------------------------------------------


def test_non_finite_input_raises() -> None:
    batch = hand_batch()
    batch["logprobs"][0, 1] = float("nan")
    with pytest.raises(NonFiniteError, match="logprobs"):
        policy_loss(**batch)
    batch = hand_batch()
    batch["advantages"][1] = float("inf")
    with pytest.raises(NonFiniteError, match="advantages"):
        policy_loss(**batch)


def test_overflowing_ratio_raises_instead_of_returning_inf() -> None:
    batch = {
        "logprobs": torch.tensor([[0.0]]),
        "behavior_logprobs": torch.tensor([[-1000.0]]),  # r = e^1000 = inf in float32
        "advantages": torch.tensor([-1.0]),
        "mask": torch.tensor([[True]]),
    }
    with pytest.raises(NonFiniteError, match="loss is"):
        policy_loss(**batch)


def test_shape_and_name_errors() -> None:
    batch = hand_batch()
    with pytest.raises(ValueError, match="loss_type='ppo' is unknown"):
        policy_loss(**batch, loss_type="ppo")
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(batch["logprobs"], batch["behavior_logprobs"], batch["advantages"][:1], batch["mask"])
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(**batch, beta=0.1)


# --- group advantages --------------------------------------------------------------------------------------


# --- the TRL 1.16 options: properties TRL cannot show -------------------------------------------------------


def option_batch(seed: int, rows: int = 7, width: int = 9) -> dict[str, torch.Tensor]:
    """A random batch with everything the options read: sampling and reference logprobs, entropies."""
    batch = random_batch(seed, rows=rows, width=width)
    generator = torch.Generator().manual_seed(seed + 100)
    shape = batch["logprobs"].shape
    batch["sampling_logprobs"] = batch["behavior_logprobs"] + torch.randn(*shape, generator=generator).double() * 0.3
    batch["ref_logprobs"] = batch["logprobs"] - 0.2
    batch["entropy"] = torch.rand(*shape, generator=generator).double() * 3
    return batch


SPLIT_OPTIONS = {
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.2},
    "sapo": {"loss_type": "sapo"},
    "luspo-sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "luspo-token": {"loss_type": "luspo"},
    "vespo": {"loss_type": "vespo"},
    "vespo-corrected": {"loss_type": "vespo", "vllm_importance_sampling_correction": True},
    "dapo-sequence": {"loss_type": "dapo", "importance_sampling_level": "sequence", "delta": 1.3},
    "grpo-sequence": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "sapo-sequence": {"loss_type": "sapo", "importance_sampling_level": "sequence"},
    "dr_grpo-opsm": {"loss_type": "dr_grpo", "off_policy_mask_threshold": 0.02},
    "dapo-sequence-mask": {
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "sequence_mask",
        "vllm_importance_sampling_clip_min": 0.5,
    },
    "grpo-token-truncate-beta": {
        "loss_type": "grpo",
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_truncate",
        "beta": 0.1,
    },
}


def call(batch: dict[str, torch.Tensor], logprobs: torch.Tensor, rows: slice, **options):
    """``policy_loss`` on the rows of ``batch`` with ``logprobs`` in place of its own."""
    part = {key: value[rows] for key, value in batch.items() if key != "logprobs"}
    if not options.pop("with_sampling", True):
        part.pop("sampling_logprobs")
    return policy_loss(logprobs[rows], **part, **options)


@pytest.mark.parametrize("name", SPLIT_OPTIONS)
def test_new_aggregations_accumulate_to_the_whole_batch(name: str) -> None:
    batch = option_batch(7)
    options = {"max_completion_length": 12, **SPLIT_OPTIONS[name]}
    if not options.get("beta"):
        batch.pop("ref_logprobs")
    whole = batch["logprobs"].clone().requires_grad_(True)
    loss, _ = call(batch, whole, slice(None), **options)
    loss.backward()

    split = batch["logprobs"].clone().requires_grad_(True)
    step = {"step_tokens": int(batch["mask"].sum()), "step_sequences": 7, "micro_batches": 3}
    accumulated = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7)):
        part, _ = call(batch, split, rows, **options, **step)
        part.backward()
        accumulated += part.item()
    assert accumulated == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-12, atol=1e-15)


def test_entropy_quantile_depends_on_the_split() -> None:
    # Documented: the threshold is this call's quantile, so (like bnpo) the split changes the result.
    batch = option_batch(8)
    batch.pop("ref_logprobs")
    logprobs = batch["logprobs"]
    whole, _ = call(batch, logprobs, slice(None), top_entropy_quantile=0.3)
    step = {"step_tokens": int(batch["mask"].sum()), "top_entropy_quantile": 0.3}
    parts = [call(batch, logprobs, rows, **step)[0].item() for rows in (slice(0, 3), slice(3, 7))]
    assert sum(parts) != pytest.approx(whole.item())


def test_cispo_and_vespo_hold_their_weights_constant() -> None:
    # Both losses are -sg(weight) * A * logprob: the gradient is -weight * A / tokens, no derivative of it.
    batch = option_batch(9)
    mask, adv = batch["mask"], batch["advantages"].unsqueeze(1)
    tokens = int(mask.sum())
    log_ratio = torch.where(mask, batch["logprobs"] - batch["behavior_logprobs"], 0.0)

    logprobs = batch["logprobs"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        logprobs, batch["behavior_logprobs"], batch["advantages"], mask, loss_type="cispo", epsilon_high=1.1
    )
    loss.backward()
    expected = torch.where(mask, -log_ratio.exp().clamp(max=1.1) * adv / tokens, 0.0)
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=1e-15)

    logprobs = batch["logprobs"].clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, batch["behavior_logprobs"], batch["advantages"], mask, loss_type="vespo")
    loss.backward()
    log_w = log_ratio.sum(dim=1, keepdim=True)
    k = torch.where(adv >= 0, 2.0, 3.0).double()
    lam = torch.where(adv >= 0, 3.0, 2.0).double()
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    torch.testing.assert_close(logprobs.grad, torch.where(mask, -phi * adv / tokens, 0.0), rtol=1e-12, atol=1e-15)


def test_vespo_weight_is_one_on_policy() -> None:
    # phi(1) = exp(lambda - lambda) = 1: on-policy, vespo is the plain policy gradient -A * logprob.
    batch = option_batch(10)
    behavior = batch["logprobs"].clone()
    loss, _ = policy_loss(batch["logprobs"], behavior, batch["advantages"], batch["mask"], loss_type="vespo")
    expected = -(batch["advantages"].unsqueeze(1) * torch.where(batch["mask"], batch["logprobs"], 0.0)).sum()
    assert loss.item() == pytest.approx(expected.item() / int(batch["mask"].sum()), rel=1e-12)


def test_bias_corrected_kl_changes_the_gradient_even_on_policy() -> None:
    batch = option_batch(11)
    behavior = batch["logprobs"].clone()
    grads = {}
    for bias in (True, False):
        logprobs = batch["logprobs"].clone().requires_grad_(True)
        loss, stats = policy_loss(
            logprobs,
            behavior,
            batch["advantages"],
            batch["mask"],
            ref_logprobs=batch["ref_logprobs"],
            beta=0.1,
            use_bias_correction_kl=bias,
        )
        loss.backward()
        grads[bias] = logprobs.grad
    # The weight is exactly 1 on-policy, so the values agree; d(w * kl) = kl * dw + dkl, so the gradients do not.
    assert not torch.allclose(grads[True], grads[False])
    kl = math.exp(-0.2) - 1 + 0.2  # ref - logp = -0.2 everywhere
    difference = torch.where(batch["mask"], 0.1 * kl / int(batch["mask"].sum()), 0.0).double()
    torch.testing.assert_close(grads[True] - grads[False], difference, rtol=1e-6, atol=1e-12)  # ref - logp ~ -0.2
    assert stats["kl_ref"] == pytest.approx(kl)


LEAK_OPTIONS = {
    **SPLIT_OPTIONS,
    "entropy": {"top_entropy_quantile": 0.4},
    "opsm-sampling": {"loss_type": "grpo", "off_policy_mask_threshold": 0.02},
    "opsm-behavior": {"loss_type": "sapo", "off_policy_mask_threshold": 0.02, "with_sampling": False},
    "given-token-ratio": {"loss_type": "dapo", "importance_sampling_level": "sequence", "given_ratio": "token"},
    "given-token-ratio-vespo": {"loss_type": "vespo", "given_ratio": "token"},
    "given-sequence-ratio": {"loss_type": "luspo", "given_ratio": "sequence"},
    **{
        f"{mode}-min": {
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": mode,
            "vllm_importance_sampling_clip_min": 0.7,
            "vllm_importance_sampling_clip_max": 2.0,
            "importance_sampling_level": "sequence",
        }
        for mode in VLLM_IMPORTANCE_SAMPLING_MODES
    },
    "everything": {
        "loss_type": "cispo",
        "epsilon_high": 3.0,
        "importance_sampling_level": "sequence",
        "off_policy_mask_threshold": 0.01,
        "top_entropy_quantile": 0.5,
        "vllm_importance_sampling_correction": True,
        "beta": 0.2,
    },
}


@pytest.mark.parametrize("name", LEAK_OPTIONS)
def test_nan_at_padding_never_leaks_with_the_new_options(name: str) -> None:
    options = dict(LEAK_OPTIONS[name])
    given = options.pop("given_ratio", None)
    if given:
        options["vllm_importance_sampling_correction"] = True
    batch = option_batch(12)
    if not options.pop("with_sampling", True):
        batch.pop("sampling_logprobs")
    if not options.get("beta"):
        batch.pop("ref_logprobs")
    padding = ~batch["mask"]
    assert padding.any()
    rows = batch["mask"].shape[0]
    ratios = {"token": torch.rand(rows, 9, dtype=torch.float64) + 0.5, "sequence": torch.rand(rows, 1).double() + 0.5}

    def run(dirty: bool) -> tuple[float, dict[str, float], torch.Tensor]:
        data = {key: value.clone() for key, value in batch.items()}
        if given:
            data["importance_sampling_ratio"] = ratios[given].clone()
        if dirty:
            for key, garbage in (
                ("logprobs", float("nan")),
                ("behavior_logprobs", 1e6),
                ("sampling_logprobs", float("nan")),
                ("ref_logprobs", float("nan")),
                ("entropy", float("nan")),
            ):
                if key in data:
                    data[key][padding] = garbage
            if given == "token":
                data["importance_sampling_ratio"][padding] = float("nan")
        logprobs = data.pop("logprobs").requires_grad_(True)
        loss, stats = policy_loss(logprobs, **data, **options)
        loss.backward()
        return loss.item(), stats, logprobs.grad

    loss_a, stats_a, grad_a = run(dirty=False)
    loss_b, stats_b, grad_b = run(dirty=True)
    assert math.isfinite(loss_a)
    assert loss_b == loss_a
    assert stats_b == stats_a
    assert torch.equal(grad_b, grad_a)
    assert (grad_a[padding] == 0).all()


def test_nan_sampling_logprob_inside_the_mask_means_no_correction() -> None:
    # A token the generator could not score: weight 1, no drift evidence, left out of the difference figures.
    batch = hand_batch()
    sampling = batch["behavior_logprobs"].clone()
    sampling[0, 0] = float("nan")
    sampling[1, 1] -= 0.5  # the sampler gave this token e^0.5 less weight than the behaviour policy
    _, stats = policy_loss(
        **batch,
        sampling_logprobs=sampling,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        off_policy_mask_threshold=0.01,
    )
    assert stats["is_ratio_min"] == 1.0
    assert stats["is_ratio_max"] == pytest.approx(math.exp(0.5))
    assert stats["is_ratio_mean"] == pytest.approx((4 + math.exp(0.5)) / 5)
    assert stats["sampling_logp_difference_mean"] == pytest.approx(0.5 / 4)
    assert stats["sampling_logp_difference_max"] == pytest.approx(0.5)
    # Row 1 (A < 0) drifts by mean(sampling - logprobs) = (0.5 - 0.5) / 2 = 0 <= 0.01: kept.
    assert stats["off_policy_masked"] == 0.0


def test_new_figures_by_hand() -> None:
    batch = hand_batch()
    # Row 1 (A = -2) drifts by mean(beh - logp) = (0.5 + 0) / 2 = 0.25 > 0.1: dropped; row 0 has A > 0: kept.
    loss, stats = policy_loss(**batch, epsilon_high=0.28, off_policy_mask_threshold=0.1)
    assert stats["off_policy_masked"] == 0.5
    assert loss.item() == pytest.approx(ROW0 / 5)
    entropy = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, float("nan")]], dtype=torch.float64)
    # Keep the top 40% of the 5 masked entropies: the 0.6 quantile of (0.1, 0.3, 0.5, 0.7, 0.9) is 0.58.
    _, stats = policy_loss(**batch, entropy=entropy, top_entropy_quantile=0.4)
    assert stats["entropy_masked"] == pytest.approx(3 / 5)
    sequence_ratio = torch.tensor([[0.5], [2.0]], dtype=torch.float64)
    _, stats = policy_loss(**batch, importance_sampling_ratio=sequence_ratio, vllm_importance_sampling_correction=True)
    assert (stats["is_ratio_min"], stats["is_ratio_mean"], stats["is_ratio_max"]) == (0.5, 1.25, 2.0)
    assert "sampling_logp_difference_mean" not in stats and "off_policy_masked" not in stats


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"importance_sampling_level": "sentence"}, "importance_sampling_level='sentence' is unknown"),
        ({"vllm_importance_sampling_mode": "token"}, "vllm_importance_sampling_mode='token' is unknown"),
        ({"loss_type": "gspo"}, "loss_type='gspo' is unknown"),
        ({"epsilon_low": -0.1}, "epsilon_low=-0.1"),
        ({"epsilon_high": -1.0}, "epsilon_high=-1.0"),
        ({"loss_type": "cispo", "epsilon_high": 0.0}, "epsilon_high=0.0"),
        ({"delta": 0.9}, "delta=0.9"),
        ({"delta": float("inf")}, "delta=inf"),
        ({"sapo_temperature_pos": 0.0}, "sapo_temperature_pos=0.0"),
        ({"sapo_temperature_neg": -1.0}, "sapo_temperature_neg=-1.0"),
        ({"vespo_k_pos": -1.0}, "vespo_k_pos=-1.0"),
        ({"vespo_lambda_pos": 0.0}, "vespo_lambda_pos=0.0"),
        ({"vespo_k_neg": float("nan")}, "vespo_k_neg=nan"),
        ({"vespo_lambda_neg": None}, "vespo_lambda_neg=None"),
        ({"off_policy_mask_threshold": -0.5}, "off_policy_mask_threshold=-0.5"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile=1.5"),
        ({"top_entropy_quantile": "0.2"}, "top_entropy_quantile='0.2'"),
        ({"vllm_importance_sampling_clip_min": -1.0}, "vllm_importance_sampling_clip_min=-1.0"),
        ({"vllm_importance_sampling_clip_max": 0.0}, "vllm_importance_sampling_clip_max=0.0"),
        ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 2.0}, "clip_min=2.0 must"),
        (
            {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
            "needs vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max",
        ),
        ({"micro_batches": 0}, "micro_batches=0"),
        ({"vllm_importance_sampling_correction": True}, "needs importance_sampling_ratio or sampling_logprobs"),
        ({"importance_sampling_ratio": torch.ones(2, 1)}, "vllm_importance_sampling_correction=False"),
        (
            {"importance_sampling_ratio": torch.ones(2, 2), "vllm_importance_sampling_correction": True},
            "importance_sampling_ratio has shape",
        ),
        ({"top_entropy_quantile": 0.5}, "top_entropy_quantile=0.5 needs entropy or logits"),
        ({"sampling_logprobs": torch.zeros(2, 4)}, "sampling_logprobs has shape"),
    ],
)
def test_bad_options_raise_naming_the_option(options: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name.replace("(", r"\(").replace("[", r"\[")):
        policy_loss(**hand_batch(), **options)


def test_a_negative_or_non_finite_given_ratio_is_refused() -> None:
    ratio = torch.tensor([[1.0, -0.5, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="importance_sampling_ratio has negative values"):
        policy_loss(**hand_batch(), importance_sampling_ratio=ratio, vllm_importance_sampling_correction=True)
    ratio[0, 1] = float("nan")
    with pytest.raises(NonFiniteError, match="importance_sampling_ratio"):
        policy_loss(**hand_batch(), importance_sampling_ratio=ratio, vllm_importance_sampling_correction=True)
