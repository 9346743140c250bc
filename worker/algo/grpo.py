"""The GRPO math, as pure functions: no I/O, no config objects, no device choices.

Exactly this variant (the definitions of TRL's ``GRPOTrainer._compute_loss`` for token-level importance
sampling, one process):

* **Group advantages** ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` with the *sample* standard
  deviation (Bessel-corrected, ``torch.std`` default, as TRL) and ``eps = 1e-4``; ``scale=False`` gives
  ``r_i - mean`` (Dr. GRPO). Every token of a completion gets its sequence's advantage.
* **Per-token loss** ``-min(r*A, clip(r, 1 - epsilon_low, 1 + epsilon_high)*A)`` with the importance
  ratio ``r = exp(logprobs - behavior_logprobs)`` against the policy that *sampled* the tokens (the
  behaviour policy, possibly several versions old in an asynchronous run). ``epsilon_high=None`` means
  ``epsilon_high = epsilon_low``. With ``beta > 0`` the per-token k3 estimate of ``KL(pi || pi_ref)``,
  ``exp(ref - logp) - (ref - logp) - 1``, is added with weight ``beta``.
* **Aggregation** over the masked tokens (``mask`` marks completion tokens; padding never counts):

  ========  ==========================================================  ==================================
  type      one micro-batch (TRL's definition)                          step split into micro-batches
  ========  ==========================================================  ==================================
  grpo      mean over sequences of each sequence's token mean           sum of sequence means / sequences
                                                                        in the step (= whole-batch value)
  bnpo      token mean of the micro-batch                               each micro-batch's token mean /
                                                                        number of micro-batches (TRL);
                                                                        depends on the split
  dr_grpo   token sum / (B * max_completion_length)                     token sum / (sequences in the step
                                                                        * max_completion_length)
                                                                        (= whole-batch value)
  dapo      token sum / tokens in the whole optimizer step              same (= whole-batch value)
  ========  ==========================================================  ==================================

  So for ``dapo``, ``grpo`` and ``dr_grpo`` the gradients accumulated over micro-batches equal the gradient of
  the whole batch; pass the step totals (``step_tokens``, ``step_sequences``) to get that. Without them a
  call is one micro-batch that is the whole step, which is TRL's single-process value.

* **Diagnostics** (masked token means, no gradient): ``ratio`` (mean r), ``kl`` (k3 of the behaviour policy
  against the current one, ``exp(beh - logp) - (beh - logp) - 1``), ``clip_low`` (r < 1 - epsilon_low with
  A < 0), ``clip_high`` (r > 1 + epsilon_high with A > 0), ``clip_region`` (either), ``entropy`` of the
  token distribution when ``logits`` (already divided by the temperature) are given, ``kl_ref`` when
  ``beta > 0``. ``tokens`` is the masked token count.

Non-finite inputs at masked positions, or a non-finite loss, raise :class:`NonFiniteError`; padding
positions may hold anything (they are selected away, never multiplied, so a NaN there cannot leak).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

LossType = Literal["dapo", "grpo", "dr_grpo", "bnpo"]
LOSS_TYPES: tuple[str, ...] = ("dapo", "grpo", "dr_grpo", "bnpo")
ADVANTAGE_EPS = 1e-4


class NonFiniteError(FloatingPointError):
    """A NaN or infinity where a finite number is needed; the message says which input or output."""


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


def _check_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> None:
    if not torch.isfinite(tensor[mask]).all():
        raise NonFiniteError(f"{name} has NaN or infinite values at completion (unmasked) positions")


def policy_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: LossType = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    max_completion_length: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    logits: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    step_tokens: int | None = None,
    step_sequences: int | None = None,
    micro_batches: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped GRPO policy loss of one micro-batch and its diagnostics (see the module docstring).

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` and ``ref_logprobs`` are (B, T); ``advantages``
    is (B,) (or (B, 1)); ``logits`` (optional, for the entropy) is (B, T, V) and already divided by the temperature;
    ``entropy`` (B, T) is the per-token entropy when the caller has it already (``token_logprobs_and_entropy``).
    ``logprobs`` carries the gradient. ``max_completion_length`` is needed by ``dr_grpo`` only (default T).
    ``step_tokens`` / ``step_sequences`` are the masked-token / sequence counts of the whole optimizer step
    (default: this micro-batch's); ``micro_batches`` divides ``bnpo`` as TRL's gradient accumulation does.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is unknown; use one of {', '.join(LOSS_TYPES)}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T); got shape {tuple(logprobs.shape)}")
    batch, width = logprobs.shape
    for name, tensor in (("behavior_logprobs", behavior_logprobs), ("mask", mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {tuple(logprobs.shape)}")
    if advantages.shape == (batch, 1):  # TRL-style column of per-sequence advantages
        advantages = advantages.squeeze(1)
    if advantages.shape != (batch,):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected ({batch},)")
    if beta > 0.0 and (ref_logprobs is None or ref_logprobs.shape != logprobs.shape):
        raise ValueError(f"beta={beta} needs ref_logprobs of shape {tuple(logprobs.shape)}")
    if mask.dtype != torch.bool:
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("mask must hold only 0 and 1 (or be a bool tensor)")
        mask = mask.bool()
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1")

    _check_finite("logprobs", logprobs.detach(), mask)
    _check_finite("behavior_logprobs", behavior_logprobs, mask)
    if not torch.isfinite(advantages).all():
        raise NonFiniteError("advantages has NaN or infinite values")
    if beta > 0.0:
        assert ref_logprobs is not None
        _check_finite("ref_logprobs", ref_logprobs, mask)

    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Padding may hold garbage (even NaN); select it away before any arithmetic can see it.
    logprobs_m = torch.where(mask, logprobs, zero)
    behavior_m = torch.where(mask, behavior_logprobs.to(logprobs.dtype), zero)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)

    ratio = torch.exp(logprobs_m - behavior_m)
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    per_token_ref_kl = None
    if beta > 0.0:
        assert ref_logprobs is not None
        ref_m = torch.where(mask, ref_logprobs.to(logprobs.dtype), zero)
        per_token_ref_kl = torch.exp(ref_m - logprobs_m) - (ref_m - logprobs_m) - 1.0
        per_token = per_token + beta * per_token_ref_kl
    per_token = torch.where(mask, per_token, zero)

    token_counts = mask.sum(dim=1)
    tokens = int(token_counts.sum())
    if loss_type == "grpo":
        sequences = step_sequences if step_sequences is not None else batch
        per_sequence = per_token.sum(dim=1) / token_counts.clamp(min=1).to(per_token.dtype)
        loss = per_sequence.sum() / max(sequences, 1)
    elif loss_type == "bnpo":
        loss = per_token.sum() / max(tokens, 1) / micro_batches
    elif loss_type == "dr_grpo":
        sequences = step_sequences if step_sequences is not None else batch
        length = max_completion_length if max_completion_length is not None else width
        if length < 1:
            raise ValueError(f"max_completion_length={length} must be >= 1 for dr_grpo")
        loss = per_token.sum() / (max(sequences, 1) * length)
    else:  # dapo
        normaliser = step_tokens if step_tokens is not None else tokens
        loss = per_token.sum() / max(normaliser, 1)

    if not torch.isfinite(loss):
        raise NonFiniteError(
            f"the {loss_type} loss is {loss.item()}: the importance ratio overflowed or the inputs are "
            "degenerate; check that behavior_logprobs come from the policy version the rollout names"
        )
    stats = _loss_stats(
        ratio.detach(),
        adv.detach(),
        logprobs_m.detach(),
        behavior_m,
        mask,
        tokens,
        epsilon_low,
        epsilon_high,
        token_entropy(logits) if entropy is None and logits is not None else entropy,
        per_token_ref_kl,
    )
    return loss, stats


@torch.no_grad()
def _loss_stats(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    logprobs: torch.Tensor,
    behavior: torch.Tensor,
    mask: torch.Tensor,
    tokens: int,
    epsilon_low: float,
    epsilon_high: float,
    entropy: torch.Tensor | None,
    per_token_ref_kl: torch.Tensor | None,
) -> dict[str, float]:
    denominator = max(tokens, 1)

    log_ratio_behavior = behavior - logprobs
    is_low = (ratio < 1.0 - epsilon_low) & (adv < 0)
    is_high = (ratio > 1.0 + epsilon_high) & (adv > 0)
    per_token = {
        "ratio": ratio,
        "kl": torch.exp(log_ratio_behavior) - log_ratio_behavior - 1.0,
        "clip_low": is_low.float(),
        "clip_high": is_high.float(),
        "clip_region": (is_low | is_high).float(),
    }
    if entropy is not None:
        per_token["entropy"] = entropy
    if per_token_ref_kl is not None:
        per_token["kl_ref"] = per_token_ref_kl.detach()
    # Masked float64 sums of every figure at once: one device sync instead of one per figure.
    stacked = torch.stack([values.to(torch.float64) for values in per_token.values()])
    sums = torch.where(mask, stacked, 0.0).flatten(1).sum(dim=1).tolist()
    stats = {name: total / denominator for name, total in zip(per_token, sums, strict=True)}
    stats["tokens"] = float(tokens)
    return stats


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis, in nats; (B, T, V) -> (B, T)."""
    log_probs = torch.log_softmax(_at_least_float32(logits), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def token_logprobs_and_entropy(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs`` (with gradient) and the detached ``token_entropy`` from one log-softmax over the
    vocabulary instead of two (the same values as the two functions)."""
    log_probs = torch.log_softmax(_at_least_float32(logits), dim=-1)
    with torch.no_grad():
        detached = log_probs.detach()
        entropy = -(detached.exp() * detached).sum(dim=-1)
    return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1), entropy


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] for each position; (B, T, V), (B, T) -> (B, T), at least float32."""
    log_probs = torch.log_softmax(_at_least_float32(logits), dim=-1)
    return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def _at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    # Half-precision log-softmax loses the small differences the importance ratio is made of.
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()
