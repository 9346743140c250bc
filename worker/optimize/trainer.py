"""The optimizer side of GRPO: rescoring, one optimizer update over a batch of rollouts, version files.

A :class:`Trainer` owns a PEFT-wrapped policy (the LoRA weights are the only trainable parameters), an AdamW
optimizer over them, the count of updates taken (which drives the learning-rate schedule) and a private RNG
(LoRA dropout), so nothing else in the process can change what the next update does. ``version_files``
serialises all of it; ``load_version_files`` restores it, and the next update is bit-identical to the one a
never-stopped trainer would take (same device, same config).

A batch is planned into micro-batches (``worker.optimize.batch``: padding-free by default); gradients
accumulate over them with the normalisers of the whole step (see ``worker.algo.grpo``), then are clipped by
global norm, and AdamW applies them. Only the model's tokens count: an agent sample's tool tokens are
forwarded as context but stay out of the loss, the ratios, every figure and the token counts.
A non-finite loss or gradient norm raises :class:`~worker.algo.grpo.NonFiniteError` and applies no update.

A trainer's state <-> bytes (the four files of a version) is ``worker.optimize.trainer_state``.

Across the ranks of a multi-GPU worker (``worker.optimize.ranks``) the public calls that touch the model are
``collective``: the leader announces each one and every rank runs it on its share of the micro-batches; the
result (metrics, ratios, logprobs) is the whole call's on every rank, equal to one rank's within float
tolerance.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors

from asyncgrpo.bucket.layout import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    TRAINER_STATE_JSON_NAME,
    TRAINER_STATE_TENSORS_NAME,
)
from asyncgrpo.protocol.records import CorrectionFigures, UpdateMetrics
from asyncgrpo.run.config import LoraConfig, LossConfig, OptimizerConfig, RunConfig
from worker.algo.grpo import NonFiniteError, policy_loss, token_logprobs, token_logprobs_and_entropy
from worker.model.attention import use_segment_attention
from worker.model.policy import (
    TRAIN_ADAPTER,
    Policy,
    decoder_layers,
    prepare_for_training,
    trainable_parameters,
    wrap_with_lora,
)
from worker.optimize.batch import (
    MicroBatch,
    TrainSample,
    collate,
    deal_to_ranks,
    plan_micro_batches,
    positions_computed,
)
from worker.optimize.ranks import Ranks, collective, reshard, shard
from worker.optimize.trainer_state import (
    VERSION_FILE_NAMES,
    TrainerState,
    TrainerStateError,
    adapter_files,
    check_adapter_config,
    decode_trainer_state,
    encode_trainer_state,
    load_adapter_weights,
)

log = structlog.get_logger()


def learning_rate_at(update: int, optimizer: OptimizerConfig) -> float:
    """LR of the 0-based ``update``: linear warmup to the peak over ``warmup_steps`` updates (the first
    update uses peak/warmup_steps), then constant, linear or cosine decay to 0 at ``total_steps``."""
    peak = optimizer.learning_rate
    if update < optimizer.warmup_steps:
        return peak * (update + 1) / optimizer.warmup_steps
    if optimizer.lr_schedule == "constant":
        return peak
    span = max(optimizer.total_steps - optimizer.warmup_steps, 1)
    progress = min(max(update - optimizer.warmup_steps, 0) / span, 1.0)
    if optimizer.lr_schedule == "linear":
        return peak * (1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def mean_ratio(
    behavior_logprobs: list[list[float]],
    logprobs: list[list[float]],
    masks: list[list[bool] | None] | None = None,
) -> float:
    """Token mean of exp(logprobs - behaviour) over the model's tokens (``masks``, per sequence: None or
    absent for all of them): 1 when a rollout was made by the weights rescoring it."""
    total, count = 0.0, 0
    for index, (behavior, current) in enumerate(zip(behavior_logprobs, logprobs, strict=True)):
        mask = masks[index] if masks is not None else None
        flags = mask if mask is not None else [True] * len(behavior)
        for b, c, model in zip(behavior, current, flags, strict=True):
            if model:  # a tool token's behaviour logprob is meaningless
                total += math.exp(c - b)
                count += 1
    return total / count if count else 1.0


RatioSums = tuple[float, float]
"""One sequence's sums over the model's completion tokens of the ratio exp(logprob - behaviour) and of its
log (a tool token, whose behaviour logprob is meaningless, adds nothing)."""


def _ratio_sums(logprobs: torch.Tensor, batch: MicroBatch) -> list[RatioSums]:
    """Per row, the sums over the model's completion tokens of the ratio and of the log ratio: one device
    sync."""
    log_ratio = torch.where(batch.model_mask, logprobs - batch.behavior_logprobs, 0.0)
    ratio = torch.where(batch.model_mask, log_ratio.exp(), 0.0)
    sums = torch.stack([ratio.sum(dim=1), log_ratio.sum(dim=1)], dim=1)
    return [(ratio, log_ratio) for ratio, log_ratio in sums.tolist()]


_FIGURES = ("ratio", "kl", "clip_low", "clip_high", "clip_region", "entropy")
"""The token-weighted figures of an update (``worker.algo.grpo``'s stats; ``kl_ref`` too when beta > 0). The
decoupled ``behavior_weight_*`` stats are not among them: the stored update record has no field for them."""


def loss_options(loss: LossConfig) -> dict[str, Any]:
    """The ``policy_loss`` keywords a run's ``[loss]`` table fixes, under their shared names (TRL's where TRL has
    the option); ``loss.decoupled`` is the trainer's to apply (it passes ``proximal_logprobs``)."""
    names = (
        "loss_type",
        "epsilon_low",
        "epsilon_high",
        "importance_sampling_level",
        "delta",
        "behavior_weight_cap",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
        "vespo_k_pos",
        "vespo_lambda_pos",
        "vespo_k_neg",
        "vespo_lambda_neg",
        "off_policy_mask_threshold",
        "top_entropy_quantile",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max",
        "use_bias_correction_kl",
        "beta",
    )
    return {name: getattr(loss, name) for name in names}


class _CorrectionTotals:
    """The correction figures of an update's micro-batches, combined on every rank: extremes of the extremes,
    means weighted by what each micro-batch averaged over (tokens, or sequences in the sequence modes)."""

    def __init__(self) -> None:
        self.low, self.high, self.gap_max = math.inf, -math.inf, 0.0
        self.ratio_sum = self.ratio_count = self.gap_sum = self.gap_count = 0.0

    def add(self, stats: dict[str, float], sequences: int, per_sequence: bool) -> None:
        if "is_ratio_mean" not in stats:
            return
        count = float(sequences) if per_sequence else stats["tokens"]
        self.low, self.high = min(self.low, stats["is_ratio_min"]), max(self.high, stats["is_ratio_max"])
        self.ratio_sum += stats["is_ratio_mean"] * count
        self.ratio_count += count
        self.gap_sum += stats.get("sampling_logp_difference_mean", 0.0) * stats["tokens"]
        self.gap_count += stats["tokens"]
        self.gap_max = max(self.gap_max, stats.get("sampling_logp_difference_max", 0.0))

    def figures(self, ranks: Ranks, device: torch.device) -> CorrectionFigures | None:
        sums = ranks.sum_floats([self.ratio_sum, self.ratio_count, self.gap_sum, self.gap_count], device)
        extremes = ranks.gather((self.low, self.high, self.gap_max))
        if not sums[1]:
            return None
        return CorrectionFigures(
            min=min(low for low, _, _ in extremes),
            mean=sums[0] / sums[1],
            max=max(high for _, high, _ in extremes),
            logp_difference_mean=sums[2] / sums[3] if sums[3] else 0.0,
            logp_difference_max=max(gap for _, _, gap in extremes),
        )


class Trainer:
    """GRPO optimizer state for one run: LoRA policy, AdamW, update counter, private RNG."""

    def __init__(
        self,
        policy: Policy,
        lora_cfg: LoraConfig,
        optimizer_cfg: OptimizerConfig,
        loss_cfg: LossConfig,
        max_completion_length: int,
        temperature: float,
        seed: int,
        ranks: Ranks | None = None,
    ) -> None:
        self.policy = policy
        self.ranks = ranks or Ranks()
        self.lora_cfg = lora_cfg
        self.optimizer_cfg = optimizer_cfg
        self.loss_cfg = loss_cfg
        self.max_completion_length = max_completion_length
        self._loss_options = loss_options(loss_cfg)
        self.temperature = temperature
        self.seed = seed
        if optimizer_cfg.padding_free and policy.model.config._attn_implementation == "sdpa":
            # Without flash-attention's varlen kernel, attend within each sequence of a packed row rather than
            # through a (T, T) block-diagonal mask (worker.model.attention).
            use_segment_attention(policy.model)
        self.model = wrap_with_lora(policy, lora_cfg, seed)
        prepare_for_training(self.model, optimizer_cfg)
        if self.ranks.distributed:
            shard(self.model, decoder_layers(self.model), self.ranks, policy.model.dtype)
        self.model.eval()
        self._eval_is_train = self._no_active_dropout()
        self.padding_free = optimizer_cfg.padding_free and self._packing_is_exact()
        self._adapter_config: bytes | None = None
        named = trainable_parameters(self.model)
        self.param_names = [name for name, _ in named]
        self.lora_parameters = [parameter for _, parameter in named]
        self.optimizer = torch.optim.AdamW(
            self.lora_parameters,
            lr=optimizer_cfg.learning_rate,
            betas=(optimizer_cfg.adam_beta1, optimizer_cfg.adam_beta2),
            weight_decay=optimizer_cfg.weight_decay,
        )
        self.updates = 0
        # The policy version the in-memory weights are; None between a version's updates and its publication.
        self.version: int | None = 0
        self._rng_cpu = torch.Generator().manual_seed(seed).get_state()
        self._rng_cuda: torch.Tensor | None = None
        if policy.device.type == "cuda":
            self._rng_cuda = torch.Generator(device=policy.device).manual_seed(seed).get_state()

    @classmethod
    def initial(cls, policy: Policy, config: RunConfig, ranks: Ranks | None = None) -> Trainer:
        """A trainer at version 0: the seeded LoRA init of ``config.seed``, no update taken; across ``ranks``
        when given (the leader has already announced the build, see ``worker.optimize.ranks``)."""
        return cls(
            policy,
            config.lora,
            config.optimizer,
            config.loss,
            max_completion_length=config.sampling.max_completion_length,
            temperature=config.sampling.temperature,
            seed=config.seed,
            ranks=ranks,
        )

    # --- forward -----------------------------------------------------------------------------------------

    def _completion_logits(self, batch: MicroBatch) -> torch.Tensor:
        """Temperature-scaled logits at the positions that predict each completion token: (B, C, V) padded,
        (1, K, V) padding-free (K completion tokens in sequence order)."""
        if batch.padding_free:
            # No attention mask: the position ids, restarting per sequence, keep attention inside each one.
            output = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                logits_to_keep=batch.logit_positions,
            )
            logits = output.logits.float()
        else:
            width = batch.completion_ids.shape[1]
            output = self.model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                use_cache=False,
                logits_to_keep=width + 1,
            )
            logits = output.logits[:, -width - 1 : -1, :].float()
        # x / 1.0 == x exactly: skip a copy of the logits at the default temperature.
        return logits if self.temperature == 1.0 else logits / self.temperature

    @staticmethod
    def _targets(batch: MicroBatch) -> torch.Tensor:
        """The completion tokens in the layout of ``_completion_logits``."""
        return batch.completion_ids[batch.mask].unsqueeze(0) if batch.padding_free else batch.completion_ids

    def _logprobs(self, batch: MicroBatch) -> torch.Tensor:
        """(B, C) logprob of each completion token (0 at padding)."""
        return batch.completion_view(token_logprobs(self._completion_logits(batch), self._targets(batch)))

    def _batches(self, samples: list[TrainSample]) -> tuple[list[MicroBatch], int]:
        """This rank's micro-batches of ``samples`` (with weight-0 fillers so every rank runs as many passes)
        and how many micro-batches the whole call has over all ranks."""
        if not samples:
            raise ValueError("no samples given")
        padding_free = self.padding_free
        lengths = [sample.length for sample in samples]
        plan = plan_micro_batches(lengths, self.optimizer_cfg.micro_batch_tokens, padding_free)
        mine = plan
        passes = len(plan)
        if self.ranks.distributed:
            costs = [positions_computed([lengths[i] for i in indices], padding_free) for indices in plan]
            dealt = deal_to_ranks(costs, self.ranks.world)
            mine = [plan[i] for i in dealt[self.ranks.rank]]
            passes = max(len(indices) for indices in dealt)
        device, pad = self.policy.device, self.policy.pad_token_id
        batches = [collate(samples, indices, pad, device, padding_free) for indices in mine]
        smallest = min(plan, key=lambda indices: positions_computed([lengths[i] for i in indices], padding_free))
        while len(batches) < passes:
            filler = collate(samples, smallest, pad, device, padding_free)
            filler.weight = 0.0
            batches.append(filler)
        return batches, len(plan)

    @collective
    @torch.no_grad()
    def rescore(self, samples: list[TrainSample], lora_values: list[torch.Tensor] | None = None) -> list[list[float]]:
        """Logprob of every completion token (a tool's too: callers mask them) under the current weights (or
        ``lora_values``, another version's LoRA in ``lora_parameters`` order, the trainer's own put back exactly
        afterwards) and the sampling temperature."""
        self._set_training(False)
        result: dict[int, list[float]] = {}
        with self._lora_swapped(lora_values):
            batches = self._batches(samples)[0]
            for batch in batches:
                logprobs = self._logprobs(batch)
                if batch.weight:
                    rows = logprobs.tolist()
                    for row, index in enumerate(batch.indices):
                        result[index] = rows[row][: len(samples[index].completion_token_ids)]
        merged = {index: value for part in self.ranks.gather(result) for index, value in part.items()}
        return [merged[index] for index in range(len(samples))]

    @collective
    def rescore_ratio_sums(
        self, samples: list[TrainSample], lora_values: list[torch.Tensor] | None = None
    ) -> list[RatioSums]:
        """Per sample, the sums over its model tokens of exp(logprob now - behaviour) and of its log;
        under ``lora_values`` (another version's LoRA, in ``lora_parameters`` order) when given, the
        trainer's own weights put back exactly afterwards."""
        self._set_training(False)
        # Nothing here meets autograd: inference mode skips even its version counters. Not across ranks: FSDP
        # would allocate its gathered parameters as inference tensors, which a later step cannot write.
        with torch.inference_mode(not self.ranks.distributed), torch.no_grad(), self._lora_swapped(lora_values):
            sums: dict[int, RatioSums] = {}
            for batch in self._batches(samples)[0]:
                if batch.weight:
                    sums.update(zip(batch.indices, _ratio_sums(self._logprobs(batch), batch), strict=True))
                else:
                    self._logprobs(batch)  # a filler pass: the collectives of a forward, no result
        merged = {index: value for part in self.ranks.gather(sums) for index, value in part.items()}
        return [merged[index] for index in range(len(samples))]

    @contextmanager
    def _lora_swapped(self, values: list[torch.Tensor] | None) -> Iterator[None]:
        if values is None:
            yield
            return
        if len(values) != len(self.lora_parameters) or any(
            value.shape != parameter.shape for value, parameter in zip(values, self.lora_parameters, strict=True)
        ):
            raise TrainerStateError("the LoRA weights to rescore under do not fit this trainer's LoRA parameters")
        saved = [parameter.detach().clone() for parameter in self.lora_parameters]
        with torch.no_grad():
            for parameter, value in zip(self.lora_parameters, values, strict=True):
                parameter.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for parameter, value in zip(self.lora_parameters, saved, strict=True):
                    parameter.copy_(value)

    def lora_values(self, weights: bytes) -> list[torch.Tensor]:
        """A saved adapter's LoRA tensors (``adapter_model.safetensors`` bytes) in ``lora_parameters`` order,
        on this trainer's device; the model is left as it is."""
        try:
            state = load_tensors(weights)
        except SafetensorError as error:
            raise TrainerStateError(f"{ADAPTER_WEIGHTS_NAME} is not a safetensors file: {error}") from error
        # PEFT saves a parameter without its adapter's name: ``...q_proj.lora_A.default.weight`` as
        # ``...q_proj.lora_A.weight``.
        saved_names = [name.replace(f".{TRAIN_ADAPTER}.", ".") for name in self.param_names]
        missing = [name for name in saved_names if name not in state]
        if missing or len(state) != len(saved_names):
            raise TrainerStateError(
                f"{ADAPTER_WEIGHTS_NAME} does not hold exactly this trainer's LoRA tensors (missing {missing[:3]}, "
                f"{len(state)} tensors for {len(saved_names)} parameters)"
            )
        return [
            state[name].to(device=parameter.device, dtype=parameter.dtype)
            for name, parameter in zip(saved_names, self.lora_parameters, strict=True)
        ]

    def _packing_is_exact(self) -> bool:
        """Whether this model keeps attention inside each sequence of a packed row: two short sequences scored
        packed and padded. transformers does for the attention kernels it ships (it reads the restarting
        position ids); a model that does not (custom remote code) trains padded instead, with a warning."""
        vocab = self.model.get_input_embeddings().num_embeddings
        ids = [token % vocab for token in range(1, 17)]
        probe = [TrainSample(ids[:5], ids[5:9], [0.0] * 4, 0.0), TrainSample(ids[9:12], ids[12:], [0.0] * 4, 0.0)]
        device, pad = self.policy.device, self.policy.pad_token_id
        with torch.no_grad():  # not inference mode: see rescore_ratio_sums
            padded = self._logprobs(collate(probe, [0, 1], pad, device, padding_free=False))
            packed = self._logprobs(collate(probe, [0, 1], pad, device, padding_free=True))
        if self.ranks.distributed:
            reshard(self.model)  # as after every call: no rank keeps parameters gathered
        gap = float((padded - packed).abs().max())
        tolerance = 1e-4 if self.policy.model.dtype == torch.float32 else 5e-2
        if gap > tolerance:
            log.warning(
                "trainer.padding_free_off",
                reason="this model attends across the sequences of a packed row",
                logprob_gap=gap,
                hint="micro-batches are padded instead; set optimizer.padding_free = false to skip this check",
            )
            return False
        return True

    @property
    def training_forward_is_eval_forward(self) -> bool:
        """Whether a training forward computes exactly what an eval forward does (no active dropout), so
        its detached logprobs can serve as the rescoring of the samples it trains on."""
        return self._eval_is_train

    def _no_active_dropout(self) -> bool:
        if self.lora_cfg.dropout > 0 or float(getattr(self.policy.model.config, "attention_dropout", 0.0)) > 0:
            return False
        return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules())

    def _set_training(self, training: bool) -> None:
        # Without dropout both modes compute the same; switching walks every module (~ms on a small model).
        # transformers checkpoints a layer only in train mode: with gradient checkpointing, switch anyway.
        if not self._eval_is_train or self.optimizer_cfg.gradient_checkpointing:
            self.model.train(training)

    @torch.no_grad()
    def _reference_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        # With LoRA, the reference (base) model is the same network with its adapter switched off.
        with self.model.disable_adapter():
            return self._logprobs(batch)

    # --- one optimizer update ----------------------------------------------------------------------------

    def step(self, samples: list[TrainSample]) -> UpdateMetrics:
        """One AdamW update over ``samples``; returns its metrics. Raises NonFiniteError without updating."""
        return self.step_with_ratio_sums(samples)[0]

    @collective
    def step_with_ratio_sums(self, samples: list[TrainSample]) -> tuple[UpdateMetrics, list[RatioSums]]:
        """``step``, also returning per sample the sums over its model tokens of exp(logprob - behaviour) and of
        its log under the weights the update started from: its rescoring, free when
        ``training_forward_is_eval_forward``."""
        batches, micro_batches = self._batches(samples)
        # The model's tokens only: a tool's answer is context, never a loss term (the loss normalisers' count).
        step_tokens = sum(s.model_tokens for s in samples if s.trained)
        if step_tokens == 0:
            raise ValueError(
                "the batch has no completion tokens of the model to train on (with "
                "loss.mask_truncated_completions, every completion of it was truncated: raise "
                "sampling.max_completion_length; or every completion token is a tool's answer)"
            )
        correcting = any(sample.corrected for sample in samples)
        cuda_devices = [self.policy.device] if self.policy.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_devices):
            torch.set_rng_state(self._rng_cpu)
            if self._rng_cuda is not None:
                torch.cuda.set_rng_state(self._rng_cuda, self.policy.device)
            try:
                metrics, ratio_sums = self._update(batches, micro_batches, len(samples), step_tokens, correcting)
            finally:
                self.optimizer.zero_grad(set_to_none=True)
                self._set_training(False)
            self._rng_cpu = torch.get_rng_state()
            if self._rng_cuda is not None:
                self._rng_cuda = torch.cuda.get_rng_state(self.policy.device)
        return metrics, ratio_sums

    def _update(
        self, batches: list[MicroBatch], micro_batches: int, sequences: int, step_tokens: int, correcting: bool
    ) -> tuple[UpdateMetrics, list[RatioSums]]:
        loss_cfg = self.loss_cfg
        self.optimizer.zero_grad(set_to_none=True)
        self._set_training(True)
        started = time.perf_counter()
        loss_total = 0.0
        weighted: dict[str, float] = {}
        ratio_sums: dict[int, RatioSums] = {}
        non_finite: NonFiniteError | None = None
        correction = _CorrectionTotals()
        per_sequence = loss_cfg.vllm_importance_sampling_mode.startswith("sequence")
        for batch in batches:
            reference = self._reference_logprobs(batch) if loss_cfg.beta > 0 else None
            logprobs, entropy = token_logprobs_and_entropy(self._completion_logits(batch), self._targets(batch))
            logprobs, entropy = batch.completion_view(logprobs), batch.completion_view(entropy)
            # A fresh corrected sample's denominator is this very forward under the version that sampled it.
            denominator = torch.where(batch.from_forward.unsqueeze(1), logprobs.detach(), batch.denominator)
            # Decoupled: the proximal policy is the weights this update starts from, i.e. this very forward
            # (one optimizer update per forward, weights unchanged between its micro-batches).
            proximal = logprobs.detach() if loss_cfg.decoupled else None
            try:
                loss, stats = policy_loss(
                    logprobs,
                    denominator,
                    batch.advantages,
                    batch.loss_mask,
                    **self._loss_options,
                    max_completion_length=self.max_completion_length,
                    proximal_logprobs=proximal,
                    ref_logprobs=reference,
                    entropy=entropy,
                    sampling_logprobs=batch.behavior_logprobs if correcting else None,
                    vllm_importance_sampling_correction=correcting,
                    step_tokens=step_tokens,
                    step_sequences=sequences,
                    micro_batches=micro_batches,
                )
            except NonFiniteError as error:
                if not self.ranks.distributed:
                    raise
                # The other ranks are in this pass's collectives: finish the passes as a filler, fail together.
                non_finite = non_finite or error
                loss, stats, batch.weight = logprobs.sum() * 0.0, {}, 0.0
            (loss * batch.weight).backward()  # a filler pass (weight 0) runs the collectives, adds nothing
            if not batch.weight:
                continue
            ratio_sums.update(zip(batch.indices, _ratio_sums(logprobs.detach(), batch), strict=True))
            correction.add(stats, len(batch.indices), per_sequence)
            loss_total += float(loss.detach())
            for key, value in stats.items():
                if key != "tokens":
                    weighted[key] = weighted.get(key, 0.0) + value * stats["tokens"]
        if self.ranks.distributed and self.ranks.sum_floats([float(non_finite is not None)], self.policy.device)[0]:
            raise non_finite or NonFiniteError(f"another rank met a non-finite loss at update {self.updates}")
        # Each rank holds the gradient of its own micro-batches: their sum is the whole step's.
        self.ranks.sum_tensors([parameter.grad for parameter in self.lora_parameters if parameter.grad is not None])
        # The same names on every rank, in one order (a rank may hold only filler passes).
        names = [*_FIGURES, *(["kl_ref"] if loss_cfg.beta > 0 else [])]
        weighted = {name: weighted.get(name, 0.0) for name in names}
        totals = self.ranks.sum_floats([loss_total, *(weighted[name] for name in names)], self.policy.device)
        loss_total, weighted = totals[0], dict(zip(names, totals[1:], strict=True))
        merged = {index: value for part in self.ranks.gather(ratio_sums) for index, value in part.items()}
        corrected = correction.figures(self.ranks, self.policy.device) if correcting else None
        if self.policy.device.type == "cuda":
            torch.cuda.synchronize(self.policy.device)
        forward_backward_s = time.perf_counter() - started

        started = time.perf_counter()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.lora_parameters, self.optimizer_cfg.max_grad_norm))
        if not math.isfinite(grad_norm):
            raise NonFiniteError(
                f"gradient norm is {grad_norm} at update {self.updates}; no update was applied. Lower "
                "optimizer.learning_rate or check the rollouts of this step"
            )
        lr = learning_rate_at(self.updates, self.optimizer_cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.policy.device.type == "cuda":
            torch.cuda.synchronize(self.policy.device)
        optimizer_s = time.perf_counter() - started

        update = self.updates
        self.updates += 1
        self.version = None
        mean = {key: value / step_tokens for key, value in weighted.items()}
        metrics = UpdateMetrics(
            update=update,
            loss=loss_total,
            ratio=mean["ratio"],
            kl=mean["kl"],
            clip_low=mean["clip_low"],
            clip_high=mean["clip_high"],
            clip_region=mean["clip_region"],
            entropy=mean["entropy"],
            grad_norm=grad_norm,
            lr=lr,
            tokens=step_tokens,
            sequences=sequences,
            micro_batches=micro_batches,
            forward_backward_s=forward_backward_s,
            optimizer_s=optimizer_s,
            kl_ref=mean.get("kl_ref"),
            importance_sampling_ratio=corrected,
        )
        return metrics, [merged[index] for index in range(sequences)]

    # --- version files -----------------------------------------------------------------------------------

    def version_files(self, version: int, extra: dict[str, Any] | None = None) -> dict[str, bytes]:
        """The four files of ``version`` (the current weights, optimizer and RNG); the trainer is then at it."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        files = adapter_files(
            self.model, base=self.policy.base, adapter_name=TRAIN_ADAPTER, config_bytes=self._adapter_config
        )
        self._adapter_config = files[ADAPTER_CONFIG_NAME]  # never changes: later versions skip save_pretrained
        state = TrainerState(
            version=version,
            updates=self.updates,
            optimizer_state={},
            rng_cpu=self._rng_cpu,
            rng_cuda=self._rng_cuda,
            extra=dict(extra or {}),
        )
        tensors, meta = encode_trainer_state(self.optimizer, self.param_names, state)
        files[TRAINER_STATE_TENSORS_NAME] = tensors
        files[TRAINER_STATE_JSON_NAME] = meta
        self.version = version
        return files

    @collective
    def load_version_files(self, files: dict[str, bytes]) -> int:
        """Restore weights, optimizer moments, update count and RNG from a version's files; returns the
        version. Files must already be verified against their manifest."""
        missing = [name for name in VERSION_FILE_NAMES if name not in files]
        if missing:
            raise TrainerStateError(f"version files lack {missing}; a version holds {list(VERSION_FILE_NAMES)}")
        check_adapter_config(files[ADAPTER_CONFIG_NAME], self.model, TRAIN_ADAPTER)
        state = decode_trainer_state(
            files[TRAINER_STATE_TENSORS_NAME], files[TRAINER_STATE_JSON_NAME], self.param_names
        )
        load_adapter_weights(self.model, files[ADAPTER_WEIGHTS_NAME], TRAIN_ADAPTER)
        self.optimizer.load_state_dict(state.optimizer_state)
        self.updates = state.updates
        self._rng_cpu = state.rng_cpu.clone()
        if self.policy.device.type == "cuda":
            self._rng_cuda = (
                state.rng_cuda.clone()
                if state.rng_cuda is not None
                else torch.Generator(device=self.policy.device).manual_seed(self.seed + self.updates).get_state()
            )
        self.version = state.version
        self.model.eval()
        log.info("trainer.loaded_version", version=state.version, updates=state.updates)
        return state.version
