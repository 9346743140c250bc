"""The GRPO math, as pure functions: no I/O, no config objects, no device choices.

``policy_loss`` implements the loss menu of TRL 1.16's ``GRPOTrainer._compute_loss`` (one process), under
TRL's option names and defaults; ``tests/unit/worker/test_loss_trl.py`` holds it against TRL's own code.

* **Group advantages** ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` with the *sample* standard
  deviation (Bessel-corrected, ``torch.std`` default, as TRL) and ``eps = 1e-4``; ``scale=False`` gives
  ``r_i - mean`` (Dr. GRPO). Every token of a completion gets its sequence's advantage.
* **Importance weight** ``w = exp(log_ratio)`` with ``log_ratio = logprobs - behavior_logprobs`` against the
  policy that the update is corrected towards (the behaviour policy, possibly several versions old in an
  asynchronous run; TRL's ``old_per_token_logps``). ``importance_sampling_level="token"`` keeps one weight
  per token; ``"sequence"`` (GSPO) uses one per sequence, ``exp`` of the masked *mean* of the log ratios,
  broadcast over the sequence's tokens.
* **Per-token loss** by ``loss_type`` (``A`` the advantage, ``lo = 1 - epsilon_low``, ``hi = 1 + epsilon_high``;
  ``epsilon_high=None`` means ``epsilon_high = epsilon_low``):

  ===========================  ========================================================================
  type                         per-token loss
  ===========================  ========================================================================
  dapo grpo dr_grpo bnpo luspo ``-min(w' * A, clip(w, lo, hi) * A)``; ``w' = min(w, delta)`` when ``delta``
                               is set (two-sided clipping, INTELLECT-2), else ``w' = w``
  cispo                        ``-sg(min(w, epsilon_high)) * A * logprobs`` (``sg``: no gradient; here
                               ``epsilon_high`` is a cap on the weight itself, MiniMax-M1)
  sapo                         ``-(4 / tau) * sigmoid(tau * (w - 1)) * A`` with ``tau =
                               sapo_temperature_pos`` when ``A > 0``, else ``sapo_temperature_neg``
  vespo                        ``-sg(phi) * A * logprobs``; ``phi = exp(lambda + k * log W - lambda * W)``
                               per sequence, ``W`` the product of the sequence's token weights (log
                               ratios clamped to [-20, 20], ``log W`` to [log 1e-8, 20]) times the
                               correction weight below; ``(k, lambda)`` are the ``vespo_*_pos`` pair
                               when ``A >= 0``, else the ``vespo_*_neg`` pair (``phi`` non-finite -> 0)
  ===========================  ========================================================================

* **Decoupled PPO** (AReaL; not in TRL), for the clipped types only, when ``proximal_logprobs`` (the policy
  right before this update, ``prox``) is given: the ratio that is clipped is taken against it, and the
  behaviour policy enters through a weight with no gradient:

  ===========================  ========================================================================
  factor                       definition
  ===========================  ========================================================================
  clipped ratio ``r``          ``exp(logprobs - prox)``: the per-token loss is the clipped row above
                               with ``r`` in place of ``w`` (``r' = min(r, delta)`` likewise)
  behavior weight ``b``        ``sg(exp(prox - behavior_logprobs))``, multiplying that per-token loss
  ``behavior_weight_cap``      a token with ``b > cap`` gets weight 0 (it leaves the policy term but
                               still counts in the denominators, like the masks below); None: no cap
  ===========================  ========================================================================

  So ``r * b = w``, and with ``prox = behavior_logprobs`` (``b = 1``) it is the plain clipped loss.
  ``importance_sampling_level="sequence"`` forms ``r`` and ``b`` alike per sequence (``exp`` of the masked
  mean log ratio), a capped ``b`` dropping its whole sequence. ``w`` itself still drives what it drives
  below (the KL factor, the ``kl`` figure); the masks and the correction weight apply as to any clipped type.

  Then, in TRL's order: sequences dropped by the **off-policy mask** (DeepSeek-V3.2: a sequence with
  ``A < 0`` whose mean of ``sampling_logprobs - logprobs`` (``behavior_logprobs`` when no
  ``sampling_logprobs``; NaN counts 0) exceeds ``off_policy_mask_threshold``) lose their policy term;
  with ``top_entropy_quantile = q < 1`` only tokens whose entropy is ``>=`` the ``(1 - q)`` quantile of
  *this call's* masked entropies keep it (so, like ``bnpo``, it depends on the micro-batch split); with
  ``vllm_importance_sampling_correction`` the policy term is multiplied by the **correction weight**
  (not for ``vespo``, which takes it into ``W``). Last, with ``beta > 0``, ``beta`` times the k3 estimate
  of ``KL(pi || pi_ref)``, ``exp(ref - logp) - (ref - logp) - 1``, is added, multiplied by ``w`` when
  ``use_bias_correction_kl`` (TRL's default: the unbiased reverse-KL gradient; it changes the gradient
  even on-policy, where ``w = 1``). None of the masks or the correction weight touch the KL term.
* **Correction weight** (training/inference mismatch): ``importance_sampling_ratio`` when given ((B, T) per
  token or (B, 1) per sequence), else computed from ``d = behavior_logprobs - sampling_logprobs`` (NaN
  ``d`` counts 0, i.e. weight 1): ``token_*`` modes ``exp(d)`` per token, ``sequence_*`` modes ``exp`` of
  the sequence's sum of ``d``; ``*_truncate`` clamps it to ``[clip_min, clip_max]``, ``*_mask`` sets it to 0
  outside that range (a bound that is ``None`` is open).
* **Aggregation** over the masked tokens (``mask`` marks completion tokens; padding never counts; the
  masks above never change the denominators):

  ==================  =========================================  =========================================
  type                one micro-batch (TRL's definition)         step split into micro-batches
  ==================  =========================================  =========================================
  grpo, sapo          mean over sequences of each sequence's     sum of sequence means / sequences in the
                      token mean                                 step (= whole-batch value)
  luspo               mean over sequences of each sequence's     sum of sequence sums / sequences in the
                      token sum                                  step (= whole-batch value)
  bnpo                token mean of the micro-batch              each micro-batch's token mean / number of
                                                                 micro-batches (TRL); depends on the split
  dr_grpo             token sum / (B * max_completion_length)    token sum / (sequences in the step *
                                                                 max_completion_length) (= whole batch)
  dapo, cispo, vespo  token sum / tokens in the optimizer step   same (= whole-batch value)
  ==================  =========================================  =========================================

  So, except for ``bnpo`` and ``top_entropy_quantile < 1``, the gradients accumulated over micro-batches
  equal the gradient of the whole batch; pass the step totals (``step_tokens``, ``step_sequences``) to get
  that. Without them a call is one micro-batch that is the whole step, which is TRL's single-process value.

* **Diagnostics** (no gradient; masked token means unless said otherwise): ``ratio`` (mean ``w``, a sequence
  weight counted once per token), ``kl`` (k3 of the behaviour policy against the current one, ``exp(beh -
  logp) - (beh - logp) - 1``), ``clip_low`` (``w < lo`` with ``A < 0``), ``clip_high`` (``w > hi`` with
  ``A > 0``; ``w`` after the ``delta`` cap, as TRL), ``clip_region`` (either); decoupled, ``ratio`` and the
  three clip figures are of ``r`` instead of ``w``, and ``behavior_weight_mean`` (mean ``b``, before the
  cap) and ``behavior_weight_masked`` (the share of tokens the cap dropped) are added. For ``cispo``,
  ``clip_high`` is TRL's ``cispo_clip_ratio`` (``w > epsilon_high`` with ``A > 0``), ``clip_low`` is 0;
  ``sapo`` and ``vespo`` clip nothing, their three figures are the trust-region drift a clipped loss would
  have clipped.
  ``entropy`` of the token distribution when ``entropy`` or ``logits`` (already divided by the temperature)
  are given, ``kl_ref`` (the KL term as added, so with the ``w`` factor under ``use_bias_correction_kl``)
  when ``beta > 0``. ``tokens`` is the masked token count. With the off-policy mask: ``off_policy_masked``,
  the share of the call's *sequences* dropped; with ``top_entropy_quantile < 1``: ``entropy_masked``, the
  share of tokens dropped. With a correction weight: ``is_ratio_min``, ``is_ratio_mean``, ``is_ratio_max``
  (TRL's ``sampling/importance_sampling_ratio/*``) over the masked tokens for a per-token weight, over the
  call's sequences for a per-sequence one (0 when there are none). With ``sampling_logprobs``:
  ``sampling_logp_difference_mean`` / ``_max``, ``|behavior_logprobs - sampling_logprobs|`` over the masked
  tokens where it is not NaN (TRL's ``sampling/sampling_logp_difference/*``). A caller combining calls must
  take the min of the ``*_min`` figures and the max of the ``*_max`` ones, not a token-weighted mean.

Non-finite inputs at masked positions, or a non-finite loss, raise :class:`NonFiniteError`
(``sampling_logprobs`` may be NaN: the generator could not score that token); padding positions may hold
anything (they are selected away, never multiplied, so a NaN there cannot leak).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Literal

import torch

LossType = Literal["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES: tuple[str, ...] = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
ImportanceSamplingLevel = Literal["token", "sequence"]
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")
VllmImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
VLLM_IMPORTANCE_SAMPLING_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# VESPO's bounds on a log weight (log 1e-8 below, as the paper's implementation).
_VESPO_LOG_MIN = math.log(1e-8)
_VESPO_LOG_MAX = 20.0


class NonFiniteError(FloatingPointError):
    """A NaN or infinity where a finite number is needed; the message says which input or output."""


def _check_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> None:
    if not torch.isfinite(tensor[mask]).all():
        raise NonFiniteError(f"{name} has NaN or infinite values at completion (unmasked) positions")


def _require(name: str, value: object, allowed: str, ok: Callable[[float], bool], *, optional: bool = False) -> None:
    """A ValueError naming the option and its allowed values unless ``value`` is a finite number that is ``ok``
    (or ``None`` when ``optional``)."""
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not ok(float(value))
    ):
        raise ValueError(f"{name}={value!r} is not allowed; use {allowed}")


def _check_options(
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    importance_sampling_level: str,
    delta: float | None,
    numbers: dict[str, float],
    off_policy_mask_threshold: float | None,
    top_entropy_quantile: float,
    vllm_mode: str,
    clip_min: float | None,
    clip_max: float | None,
    micro_batches: int,
) -> None:
    """A ValueError naming the option and its allowed values for every option outside its domain."""
    for name, value, allowed in (
        ("loss_type", loss_type, LOSS_TYPES),
        ("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS),
        ("vllm_importance_sampling_mode", vllm_mode, VLLM_IMPORTANCE_SAMPLING_MODES),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is unknown; use one of {', '.join(allowed)}")
    _require("epsilon_low", epsilon_low, "a number in [0, 1]", lambda x: 0 <= x <= 1)
    if loss_type == "cispo":
        _require("epsilon_high", epsilon_high, "a number > 0 (cispo caps the weight at it)", lambda x: x > 0)
    else:
        _require("epsilon_high", epsilon_high, "None or a number >= 0", lambda x: x >= 0)
    _require("delta", delta, "None or a number > 1 (the cap on the weight)", lambda x: x > 1, optional=True)
    for name, value in numbers.items():
        if "lambda" in name or "temperature" in name:
            _require(name, value, "a number > 0", lambda x: x > 0)
        else:
            _require(name, value, "a number >= 0", lambda x: x >= 0)
    _require(
        "off_policy_mask_threshold", off_policy_mask_threshold, "None or a number >= 0", lambda x: x >= 0, optional=True
    )
    _require(
        "top_entropy_quantile", top_entropy_quantile, "a number in [0, 1] (1 keeps every token)", lambda x: 0 <= x <= 1
    )
    _require("vllm_importance_sampling_clip_min", clip_min, "None or a number >= 0", lambda x: x >= 0, optional=True)
    _require("vllm_importance_sampling_clip_max", clip_max, "None or a number > 0", lambda x: x > 0, optional=True)
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(
            f"vllm_importance_sampling_clip_min={clip_min} must be below vllm_importance_sampling_clip_max={clip_max}"
        )
    if vllm_mode.endswith("_truncate") and clip_min is None and clip_max is None:
        raise ValueError(
            f"vllm_importance_sampling_mode={vllm_mode!r} needs vllm_importance_sampling_clip_min or "
            "vllm_importance_sampling_clip_max; set at least one"
        )
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} is not allowed; use an integer >= 1")


def _check_decoupled(loss_type: str, decoupled: bool, behavior_weight_cap: float | None) -> None:
    """A ValueError naming the option for a decoupled call outside the clipped types, or a cap without one."""
    if decoupled and loss_type in ("cispo", "sapo", "vespo"):
        raise ValueError(
            f"proximal_logprobs (decoupled) needs a clipped loss_type; loss_type={loss_type!r} has no clipped "
            "ratio: use one of dapo, grpo, dr_grpo, bnpo, luspo, or do not pass proximal_logprobs"
        )
    if behavior_weight_cap is not None and not decoupled:
        raise ValueError(
            f"behavior_weight_cap={behavior_weight_cap!r} caps the decoupled behavior weight: pass "
            "proximal_logprobs, or leave behavior_weight_cap None"
        )
    _require("behavior_weight_cap", behavior_weight_cap, "None or a number > 1", lambda x: x > 1, optional=True)


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
    importance_sampling_level: ImportanceSamplingLevel = "token",
    delta: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    behavior_weight_cap: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    off_policy_mask_threshold: float | None = None,
    top_entropy_quantile: float = 1.0,
    sampling_logprobs: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    vllm_importance_sampling_correction: bool = False,
    vllm_importance_sampling_mode: VllmImportanceSamplingMode = "sequence_mask",
    vllm_importance_sampling_clip_min: float | None = None,
    vllm_importance_sampling_clip_max: float | None = 3.0,
    use_bias_correction_kl: bool = True,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    logits: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    step_tokens: int | None = None,
    step_sequences: int | None = None,
    micro_batches: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO-family policy loss of one micro-batch and its diagnostics (see the module docstring).

    Shapes: ``logprobs``, ``behavior_logprobs``, ``proximal_logprobs``, ``mask``, ``ref_logprobs``,
    ``sampling_logprobs`` (the generator's own logprobs of the sampled tokens) and ``entropy`` are (B, T);
    ``advantages`` is (B,) (or (B, 1)); ``importance_sampling_ratio`` is (B, T) or (B, 1); ``logits``
    (optional, for the entropy) is (B, T, V) and already divided by the temperature. ``logprobs`` carries the
    gradient; nothing else does.
    ``max_completion_length`` is needed by ``dr_grpo`` only (default T). ``step_tokens`` / ``step_sequences``
    are the masked-token / sequence counts of the whole optimizer step (default: this micro-batch's);
    ``micro_batches`` divides ``bnpo`` as TRL's gradient accumulation does.

    ``vllm_importance_sampling_correction=True`` applies the correction weight: ``importance_sampling_ratio``
    when given, else the one ``vllm_importance_sampling_mode`` / ``_clip_min`` / ``_clip_max`` make of
    ``sampling_logprobs``. ``top_entropy_quantile < 1`` needs ``entropy`` or ``logits``.

    ``proximal_logprobs`` (the policy right before this update; a clipped ``loss_type`` only) turns on the
    decoupled objective, ``behavior_weight_cap`` (> 1, or None) its cap on the behavior weight.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    _check_options(
        loss_type,
        epsilon_low,
        epsilon_high,
        importance_sampling_level,
        delta,
        {
            "sapo_temperature_pos": sapo_temperature_pos,
            "sapo_temperature_neg": sapo_temperature_neg,
            "vespo_k_pos": vespo_k_pos,
            "vespo_lambda_pos": vespo_lambda_pos,
            "vespo_k_neg": vespo_k_neg,
            "vespo_lambda_neg": vespo_lambda_neg,
        },
        off_policy_mask_threshold,
        top_entropy_quantile,
        vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max,
        micro_batches,
    )
    _check_decoupled(loss_type, proximal_logprobs is not None, behavior_weight_cap)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T); got shape {tuple(logprobs.shape)}")
    batch, width = logprobs.shape
    for name, tensor in (
        ("behavior_logprobs", behavior_logprobs),
        ("proximal_logprobs", proximal_logprobs),
        ("mask", mask),
        ("sampling_logprobs", sampling_logprobs),
        ("entropy", entropy),
    ):
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {tuple(logprobs.shape)}")
    if advantages.shape == (batch, 1):  # TRL-style column of per-sequence advantages
        advantages = advantages.squeeze(1)
    if advantages.shape != (batch,):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected ({batch},)")
    if beta > 0.0 and (ref_logprobs is None or ref_logprobs.shape != logprobs.shape):
        raise ValueError(f"beta={beta} needs ref_logprobs of shape {tuple(logprobs.shape)}")
    if logits is not None and logits.shape[:2] != logprobs.shape:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected ({batch}, {width}, V)")
    if top_entropy_quantile < 1.0 and entropy is None and logits is None:
        raise ValueError(f"top_entropy_quantile={top_entropy_quantile} needs entropy or logits")
    if importance_sampling_ratio is not None:
        if not vllm_importance_sampling_correction:
            raise ValueError(
                "importance_sampling_ratio is given but vllm_importance_sampling_correction=False; set it to True "
                "to apply the weight, or do not pass it"
            )
        if importance_sampling_ratio.shape == (batch,):
            importance_sampling_ratio = importance_sampling_ratio.unsqueeze(1)
        if importance_sampling_ratio.shape not in ((batch, width), (batch, 1)):
            raise ValueError(
                f"importance_sampling_ratio has shape {tuple(importance_sampling_ratio.shape)}; expected "
                f"({batch}, {width}) per token or ({batch}, 1) per sequence"
            )
    elif vllm_importance_sampling_correction and sampling_logprobs is None:
        raise ValueError(
            "vllm_importance_sampling_correction=True needs importance_sampling_ratio or sampling_logprobs"
        )
    if mask.dtype != torch.bool:
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("mask must hold only 0 and 1 (or be a bool tensor)")
        mask = mask.bool()

    _check_finite("logprobs", logprobs.detach(), mask)
    _check_finite("behavior_logprobs", behavior_logprobs, mask)
    if proximal_logprobs is not None:
        _check_finite("proximal_logprobs", proximal_logprobs.detach(), mask)
    if not torch.isfinite(advantages).all():
        raise NonFiniteError("advantages has NaN or infinite values")
    if beta > 0.0:
        assert ref_logprobs is not None
        _check_finite("ref_logprobs", ref_logprobs, mask)
    if entropy is None and logits is not None:
        entropy = token_entropy(logits)
    if top_entropy_quantile < 1.0:
        assert entropy is not None
        _check_finite("entropy", entropy, mask)

    dtype = logprobs.dtype
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    # Padding may hold garbage (even NaN); select it away before any arithmetic can see it.
    logprobs_m = torch.where(mask, logprobs, zero)
    behavior_m = torch.where(mask, behavior_logprobs.to(dtype), zero)
    adv = advantages.to(dtype).unsqueeze(1)  # (B, 1)
    token_counts = mask.sum(dim=1, keepdim=True)  # (B, 1)
    tokens = int(token_counts.sum())

    log_ratio = logprobs_m - behavior_m  # (B, T), 0 at padding
    if importance_sampling_level == "sequence":
        log_weight = log_ratio.sum(dim=1, keepdim=True) / token_counts.clamp(min=1).to(dtype)  # (B, 1)
    else:
        log_weight = log_ratio
    weight = torch.exp(log_weight)  # coef_1: (B, T) or (B, 1)
    ratio = weight  # the ratio the clipped types clip
    behavior_weight = None  # decoupled: (B, T) or (B, 1), no gradient
    if proximal_logprobs is not None:
        proximal_m = torch.where(mask, proximal_logprobs.detach().to(dtype), zero)
        log_ratio_proximal = logprobs_m - proximal_m
        log_behavior_weight = proximal_m - behavior_m
        if importance_sampling_level == "sequence":
            lengths = token_counts.clamp(min=1).to(dtype)
            log_ratio_proximal = log_ratio_proximal.sum(dim=1, keepdim=True) / lengths
            log_behavior_weight = log_behavior_weight.sum(dim=1, keepdim=True) / lengths
        ratio = torch.exp(log_ratio_proximal)
        behavior_weight = torch.exp(log_behavior_weight)

    extra: dict[str, torch.Tensor] = {}  # 0-dim diagnostics, read back with the token means in one sync
    keep_sequence = None
    if off_policy_mask_threshold is not None:
        judged = behavior_logprobs if sampling_logprobs is None else sampling_logprobs
        # Forward KL estimate log(pi_sampler / pi_theta); a token the generator could not score (NaN) counts 0.
        drift = torch.where(mask, judged.to(dtype) - logprobs_m.detach(), zero).nan_to_num(nan=0.0)
        mean_drift = drift.sum(dim=1, keepdim=True) / token_counts.clamp(min=1).to(dtype)
        keep_sequence = (adv >= 0) | (mean_drift <= off_policy_mask_threshold)  # (B, 1)
        extra["off_policy_masked"] = (~keep_sequence).sum() / max(batch, 1)

    keep_token = None
    if top_entropy_quantile < 1.0:
        assert entropy is not None
        keep_token = _high_entropy_tokens(entropy.detach(), mask, 1.0 - top_entropy_quantile)
        extra["entropy_masked"] = (mask & ~keep_token).sum() / max(tokens, 1)

    correction = None  # the correction weight, (B, T) or (B, 1), no gradient
    if vllm_importance_sampling_correction:
        if importance_sampling_ratio is not None:
            correction = importance_sampling_ratio.detach().to(dtype)
            per_sequence = correction.shape[1] == 1 and (
                width > 1 or vllm_importance_sampling_mode.startswith("sequence")
            )
            checked = correction.expand(batch, width) if per_sequence else correction
            rows = torch.ones_like(mask) if per_sequence else mask
            _check_finite("importance_sampling_ratio", checked, rows)
            if (checked[rows] < 0).any():
                raise ValueError("importance_sampling_ratio has negative values; a weight must be >= 0")
            if not per_sequence:  # weight 1 at padding: a NaN there would reach the gradient through a product
                correction = torch.where(mask, correction, torch.ones((), dtype=dtype, device=correction.device))
        else:
            assert sampling_logprobs is not None
            per_sequence = vllm_importance_sampling_mode.startswith("sequence")
            correction = _correction_weight(
                behavior_m,
                sampling_logprobs.detach().to(dtype),
                mask,
                vllm_importance_sampling_mode,
                vllm_importance_sampling_clip_min,
                vllm_importance_sampling_clip_max,
            )
        if per_sequence:
            values, valid = correction.reshape(-1), torch.ones(batch, dtype=torch.bool, device=mask.device)
        else:
            values, valid = correction, mask
        extra.update(_min_mean_max("is_ratio", values, valid))
    if sampling_logprobs is not None:
        gap = (behavior_m - sampling_logprobs.detach().to(dtype)).abs()
        scored = mask & ~torch.isnan(gap)
        gap_stats = _min_mean_max("sampling_logp_difference", gap, scored)
        del gap_stats["sampling_logp_difference_min"]
        extra.update(gap_stats)

    per_token_ref_kl = None
    if beta > 0.0:
        assert ref_logprobs is not None
        ref_m = torch.where(mask, ref_logprobs.to(dtype), zero)
        per_token_ref_kl = torch.exp(ref_m - logprobs_m) - (ref_m - logprobs_m) - 1.0
        if use_bias_correction_kl:
            per_token_ref_kl = per_token_ref_kl * weight  # the sequence weight broadcasts at "sequence" level

    clip_weight = ratio  # the weight the clip figures are judged on
    behavior_weight_dropped = None
    if loss_type == "cispo":
        capped = torch.clamp(weight, max=epsilon_high).detach()
        per_token = -capped * adv * logprobs_m
    elif loss_type == "sapo":
        temperature = torch.where(
            adv > 0, torch.tensor(sapo_temperature_pos, dtype=dtype), torch.tensor(sapo_temperature_neg, dtype=dtype)
        )
        per_token = -(4.0 / temperature) * torch.sigmoid(temperature * (weight - 1.0)) * adv
    elif loss_type == "vespo":
        phi = _vespo_gamma_weight(
            log_ratio.detach(),
            mask,
            adv,
            correction,
            (vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg),
        )
        per_token = -phi * adv * logprobs_m
    else:  # the clipped surrogate
        clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        if delta is not None:
            clip_weight = torch.clamp(ratio, max=delta)
        per_token = -torch.min(clip_weight * adv, clipped * adv)
        if behavior_weight is not None:
            applied = behavior_weight
            if behavior_weight_cap is not None:
                behavior_weight_dropped = behavior_weight > behavior_weight_cap
                # Zero the weight itself, not the product: an overflowed b (inf) would make a NaN gradient.
                applied = torch.where(behavior_weight_dropped, zero, behavior_weight)
            per_token = per_token * applied
    per_token = per_token.expand(batch, width)
    if keep_sequence is not None:
        per_token = torch.where(keep_sequence, per_token, zero)
    if keep_token is not None:
        per_token = torch.where(keep_token, per_token, zero)
    if correction is not None and loss_type != "vespo":
        per_token = per_token * correction
    if per_token_ref_kl is not None:
        per_token = per_token + beta * per_token_ref_kl
    per_token = torch.where(mask, per_token, zero)

    if loss_type in ("grpo", "sapo"):
        sequences = step_sequences if step_sequences is not None else batch
        per_sequence_loss = per_token.sum(dim=1) / token_counts.squeeze(1).clamp(min=1).to(dtype)
        loss = per_sequence_loss.sum() / max(sequences, 1)
    elif loss_type == "luspo":
        sequences = step_sequences if step_sequences is not None else batch
        loss = per_token.sum() / max(sequences, 1)
    elif loss_type == "bnpo":
        loss = per_token.sum() / max(tokens, 1) / micro_batches
    elif loss_type == "dr_grpo":
        sequences = step_sequences if step_sequences is not None else batch
        length = max_completion_length if max_completion_length is not None else width
        if length < 1:
            raise ValueError(f"max_completion_length={length} must be >= 1 for dr_grpo")
        loss = per_token.sum() / (max(sequences, 1) * length)
    else:  # dapo, cispo, vespo
        normaliser = step_tokens if step_tokens is not None else tokens
        loss = per_token.sum() / max(normaliser, 1)

    if not torch.isfinite(loss):
        raise NonFiniteError(
            f"the {loss_type} loss is {loss.item()}: the importance ratio overflowed or the inputs are "
            "degenerate; check that behavior_logprobs come from the policy version the rollout names"
        )
    if loss_type == "cispo":
        is_low = torch.zeros_like(mask)
        is_high = (weight > epsilon_high) & (adv > 0)
    else:
        is_low = (clip_weight < 1.0 - epsilon_low) & (adv < 0)
        is_high = (clip_weight > 1.0 + epsilon_high) & (adv > 0)
    stats = _loss_stats(
        {
            "ratio": ratio.detach().expand(batch, width),
            "kl": torch.exp(-log_ratio.detach()) + log_ratio.detach() - 1.0,
            "clip_low": is_low.expand(batch, width),
            "clip_high": is_high.expand(batch, width),
            "clip_region": (is_low | is_high).expand(batch, width),
            **({"entropy": entropy} if entropy is not None else {}),
            **({"kl_ref": per_token_ref_kl.detach()} if per_token_ref_kl is not None else {}),
            **(
                {
                    "behavior_weight_mean": behavior_weight.expand(batch, width),
                    "behavior_weight_masked": (
                        torch.zeros_like(mask) if behavior_weight_dropped is None else behavior_weight_dropped
                    ).expand(batch, width),
                }
                if behavior_weight is not None
                else {}
            ),
        },
        extra,
        mask,
        tokens,
    )
    return loss, stats


def _high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Masked tokens whose entropy is at least the ``quantile`` of this call's masked entropies (bool (B, T))."""
    masked = entropy[mask]
    if masked.numel() == 0:
        return torch.zeros_like(mask)
    # The threshold in float32, as TRL computes it (it decides ties against a float64 entropy the same way).
    threshold = torch.quantile(masked.float(), quantile)
    return (torch.where(mask, entropy, 0.0) >= threshold) & mask


def _correction_weight(
    behavior: torch.Tensor,
    sampling: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """The training/inference mismatch weight ``pi_behavior / pi_sampler``: (B, T) for ``token_*`` modes,
    (B, 1) for ``sequence_*`` ones; 1 where the sampler gave no logprob (NaN) and at padding."""
    log_gap = torch.where(mask, behavior - sampling, 0.0).nan_to_num(nan=0.0)
    if mode.startswith("sequence"):
        log_gap = log_gap.sum(dim=1, keepdim=True)
    ratio = torch.exp(log_gap)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    outside = torch.zeros_like(ratio, dtype=torch.bool)
    if clip_min is not None:
        outside |= ratio < clip_min
    if clip_max is not None:
        outside |= ratio > clip_max
    return ratio.masked_fill(outside, 0.0)


@torch.no_grad()
def _vespo_gamma_weight(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    correction: torch.Tensor | None,
    parameters: tuple[float, float, float, float],
) -> torch.Tensor:
    """VESPO's per-sequence gamma weight ``phi(W) = exp(lambda + k log W - lambda W)`` ((B, 1), no gradient),
    which is 1 at ``W = 1`` and 0 where it is not finite."""
    k_pos, lambda_pos, k_neg, lambda_neg = parameters
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    log_w = torch.where(mask, log_ratio.clamp(-20.0, 20.0), zero).sum(dim=1, keepdim=True)
    if correction is not None:
        log_correction = torch.log(correction).clamp(_VESPO_LOG_MIN, _VESPO_LOG_MAX)
        if correction.shape[1] > 1:
            log_correction = torch.where(mask, log_correction, zero)
        log_w = log_w + log_correction.sum(dim=1, keepdim=True)
    log_w = log_w.clamp(_VESPO_LOG_MIN, _VESPO_LOG_MAX)
    non_negative = adv >= 0
    k = torch.where(non_negative, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(non_negative, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _min_mean_max(prefix: str, values: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """0-dim min, mean and max of ``values[valid]`` (all 0 when nothing is valid), without a device sync."""
    count = valid.sum()
    any_valid = count > 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    inf = torch.full((), math.inf, dtype=values.dtype, device=values.device)
    return {
        f"{prefix}_min": torch.where(any_valid, torch.where(valid, values, inf).amin(), zero),
        f"{prefix}_mean": torch.where(valid, values, zero).sum() / count.clamp(min=1),
        f"{prefix}_max": torch.where(any_valid, torch.where(valid, values, -inf).amax(), zero),
    }


@torch.no_grad()
def _loss_stats(
    per_token: dict[str, torch.Tensor],
    extra: dict[str, torch.Tensor],
    mask: torch.Tensor,
    tokens: int,
) -> dict[str, float]:
    # Masked float64 sums of every token figure and the 0-dim extras at once: one device sync, not one per figure.
    stacked = torch.stack([values.to(torch.float64) for values in per_token.values()])
    sums = torch.where(mask, stacked, 0.0).flatten(1).sum(dim=1) / max(tokens, 1)
    if extra:
        sums = torch.cat([sums, torch.stack([value.to(torch.float64) for value in extra.values()])])
    values = sums.tolist()
    stats = dict(zip([*per_token, *extra], values, strict=True))
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
