"""A step's batch as the trainer consumes it: train samples from the claimed rollouts, split into optimizer
updates without cutting a group, planned into micro-batches under a token budget, laid out as tensors, and
shared out between the ranks of a multi-GPU worker.

Two layouts of a micro-batch (``optimizer.padding_free``):

* **padding-free** (the default): the micro-batch's sequences concatenated in one row, position ids
  restarting at 0 for each sequence and no attention mask, so attention stays inside each sequence
  (``worker.model.attention`` attends within each sequence's slice; flash-attention's varlen kernel reads
  the same ids). Only the logits of positions that predict a completion token are computed, then laid out
  as the padded ``(B, C)`` view the loss reads. ``micro_batch_tokens`` bounds the real tokens of a row.
* **padded**: rows of left-padded prompts followed by right-padded completions, so the logits of every
  completion token are the last ``C + 1`` positions; ``micro_batch_tokens`` bounds rows x longest row.

Both give the same logprobs, loss and gradients (a test keeps them equal); padding-free computes no padding
position, which on a long-tailed length mix is most of a padded batch.

Agent samples: a completion may hold tool or environment tokens (``completion_mask`` False). They keep their
positions (later model tokens read them as context), so ``MicroBatch.mask`` is still every real completion
token, which the layouts and ``completion_view`` follow; ``model_mask`` drops the tool tokens and is what
ratios count, and ``loss_mask`` is ``model_mask`` of the trained rows, all the loss and its figures see.

Ranks: the micro-batches of an update are planned once, for the whole step, then dealt out to ranks by
tokens (largest first, to the least loaded rank). Every rank runs the same number of forward/backward
passes (FSDP's collectives pair up pass by pass), so a rank short of work repeats one of its micro-batches
with weight 0: it adds nothing to the gradient or the figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from asyncgrpo.run.config import LossConfig
from worker.algo.rollout import Rollout


@dataclass
class TrainSample:
    """One completion to train on: tokens, the behaviour logprob of each completion token, its advantage."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behavior_logprobs: list[float]
    advantage: float
    version: int = 0  # its rollout's version: the oldest token's (for staleness bookkeeping; not used by the math)
    # The generator-trainer correction applies (loss.vllm_importance_sampling_correction): the PPO denominator
    # is the trainer's logprobs under ``version``, ``old_logprobs``, or when None those of the training forward
    # itself (a fresh sample in the step's first update), and ``behavior_logprobs`` only weigh the loss.
    corrected: bool = False
    old_logprobs: list[float] | None = None
    trained: bool = True  # False: left out of the loss (a truncated completion, loss.mask_truncated_completions)
    # Per completion token, whether the model sampled it (False: a tool's answer, in no loss, ratio or count;
    # its behaviour logprob is meaningless); None: every completion token is the model's.
    completion_mask: list[bool] | None = None
    # Per completion token, the version that sampled it (async.inflight_versions = "follow"); None: ``version``.
    token_versions: list[int] | None = None
    # Model tokens masked out (completion_mask False) because their version fell out of the staleness window
    # (async.stale_tokens = "mask").
    masked_stale: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a train sample needs at least one prompt token")
        if len(self.completion_token_ids) != len(self.behavior_logprobs):
            raise ValueError(
                f"a train sample has {len(self.completion_token_ids)} completion tokens but "
                f"{len(self.behavior_logprobs)} behaviour logprobs; they must align one to one"
            )
        if self.old_logprobs is not None and len(self.old_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"a train sample has {len(self.completion_token_ids)} completion tokens but "
                f"{len(self.old_logprobs)} rescored logprobs; they must align one to one"
            )
        if self.completion_mask is not None and len(self.completion_mask) != len(self.completion_token_ids):
            raise ValueError(
                f"a train sample has {len(self.completion_token_ids)} completion tokens but a mask of "
                f"{len(self.completion_mask)}; they must align one to one"
            )
        if self.token_versions is not None and len(self.token_versions) != len(self.completion_token_ids):
            raise ValueError(
                f"a train sample has {len(self.completion_token_ids)} completion tokens but "
                f"{len(self.token_versions)} token versions; they must align one to one"
            )

    @property
    def length(self) -> int:
        """Positions a forward computes: prompt and every completion token, tool tokens included."""
        return len(self.prompt_token_ids) + len(self.completion_token_ids)

    @property
    def model_tokens(self) -> int:
        """Completion tokens the model sampled: the ones that train and count."""
        if self.completion_mask is None:
            return len(self.completion_token_ids)
        return sum(self.completion_mask)

    def model_flags(self) -> list[bool]:
        """Per completion token, whether the model sampled it."""
        if self.completion_mask is None:
            return [True] * len(self.completion_token_ids)
        return list(self.completion_mask)

    def versions(self) -> list[int]:
        """The versions that sampled its model tokens, oldest first (one, unless it followed newer versions)."""
        if self.token_versions is None:
            return [self.version]
        return sorted({v for v, model in zip(self.token_versions, self.model_flags(), strict=True) if model})

    def oldest_version(self) -> int:
        """The oldest version that sampled one of its tokens: what its staleness is."""
        return min(self.token_versions) if self.token_versions else self.version

    def segment(self, version: int) -> TrainSample:
        """The sample seen as the tokens ``version`` sampled: the others' mask is off (they keep their positions,
        as a tool's answer does), so a rescoring under ``version`` counts only its own tokens."""
        if self.token_versions is None:
            return self
        flags = [model and v == version for v, model in zip(self.token_versions, self.model_flags(), strict=True)]
        return replace(self, completion_mask=flags, token_versions=None, version=version)


def corrects(rollout: Rollout, setting: bool | None) -> bool:
    """Whether the generator-trainer correction applies to ``rollout`` under
    ``loss.vllm_importance_sampling_correction = setting``: unset, for the vLLM backend's rollouts only (the
    transformers backend's logprobs come from the trainer's own forward)."""
    return setting if setting is not None else rollout.extra.sampler == "vllm"


def _window_mask(mask: list[bool] | None, versions: list[int], oldest_trained: int) -> tuple[list[bool] | None, int]:
    """``mask`` with the model tokens older than ``oldest_trained`` turned off, and how many were."""
    if not versions or min(versions) >= oldest_trained:
        return mask, 0
    flags = mask or [True] * len(versions)
    kept = [model and version >= oldest_trained for model, version in zip(flags, versions, strict=True)]
    return kept, sum(flags) - sum(kept)


def build_train_samples(
    rollouts: list[Rollout], loss: LossConfig | None = None, oldest_trained: int | None = None
) -> tuple[list[TrainSample], list[tuple[int, int]]]:
    """Flatten rollouts into train samples (marked for the correction and the truncation mask of ``loss``);
    also return each sample's (rollout index, group index). ``oldest_trained`` (``async.stale_tokens =
    "mask"``): tokens sampled by an older version are masked out, like a tool's (no loss, ratio or count), and
    counted in ``masked_stale``."""
    samples: list[TrainSample] = []
    keys: list[tuple[int, int]] = []
    for owner, rollout in enumerate(rollouts):
        corrected = corrects(rollout, loss.vllm_importance_sampling_correction) if loss else False
        for sample in rollout.samples:
            truncated = sample.finish_reason == "length"
            mask, masked = sample.completion_mask, 0
            if oldest_trained is not None:
                versions = sample.token_versions or [rollout.version] * len(sample.completion_token_ids)
                mask, masked = _window_mask(sample.completion_mask, versions, oldest_trained)
            samples.append(
                TrainSample(
                    prompt_token_ids=sample.prompt_token_ids,
                    completion_token_ids=sample.completion_token_ids,
                    behavior_logprobs=sample.behavior_logprobs,
                    advantage=sample.advantage,
                    version=rollout.version,
                    corrected=corrected,
                    trained=not (loss is not None and loss.mask_truncated_completions and truncated),
                    completion_mask=mask,
                    token_versions=sample.token_versions,
                    masked_stale=masked,
                )
            )
            keys.append((owner, sample.group_index))
    return samples, keys


def split_by_group(samples: list[TrainSample], keys: list[tuple[int, int]], parts: int) -> list[list[TrainSample]]:
    """Split the batch into ``parts`` optimizer updates without cutting a group."""
    return [[samples[i] for i in chunk] for chunk in split_indices_by_group(keys, parts)]


def split_indices_by_group(keys: list[tuple[int, int]], parts: int) -> list[list[int]]:
    """``split_by_group`` as sample indices: the samples of each optimizer update."""
    if parts == 1:
        return [list(range(len(keys)))]
    keyed: dict[tuple[int, int], list[int]] = {}
    for index, key in enumerate(keys):
        keyed.setdefault(key, []).append(index)
    groups = list(keyed.values())
    size = math.ceil(len(groups) / parts)
    return [[i for g in groups[start : start + size] for i in g] for start in range(0, len(groups), size)]


# ---- planning: which samples share a micro-batch ----


def pack_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Padded plan: sample indices in micro-batches of at most ``token_budget`` padded tokens (rows x longest).

    Longest first, so rows of similar length share a batch; a sample longer than the budget goes alone.
    Deterministic for given lengths.
    """
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    batches: list[list[int]] = []
    current: list[int] = []
    current_longest = 0
    for index in order:
        longest = max(current_longest, lengths[index])
        if current and (len(current) + 1) * longest > token_budget:
            batches.append(current)
            current, longest = [], lengths[index]
        current.append(index)
        current_longest = longest
    if current:
        batches.append(current)
    return batches


def pack_padding_free(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Padding-free plan: sample indices in rows of at most ``token_budget`` real tokens.

    First fit over the samples longest first (a row takes the first sample that still fits it), so short
    completions fill the space long ones leave; a sample longer than the budget goes alone. Each row keeps
    its samples in index order. Deterministic for given lengths.
    """
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    rows: list[list[int]] = []
    used: list[int] = []
    for index in order:
        length = lengths[index]
        for row, tokens in enumerate(used):
            if tokens + length <= token_budget:
                rows[row].append(index)
                used[row] += length
                break
        else:
            rows.append([index])
            used.append(length)
    return [sorted(row) for row in rows]


def plan_micro_batches(lengths: list[int], token_budget: int, padding_free: bool) -> list[list[int]]:
    """The micro-batches of one update, as sample indices, in the layout ``padding_free`` chooses."""
    return pack_padding_free(lengths, token_budget) if padding_free else pack_micro_batches(lengths, token_budget)


def positions_computed(lengths: list[int], padding_free: bool) -> int:
    """Positions one forward of a micro-batch of ``lengths`` computes: the padding share is 1 - real / this."""
    return sum(lengths) if padding_free else len(lengths) * max(lengths, default=0)


def deal_to_ranks(costs: list[int], ranks: int) -> list[list[int]]:
    """Micro-batch indices per rank, balanced by ``costs`` (tokens): largest first to the least loaded rank
    (ties to the lower rank). Each rank's list is in micro-batch order. Deterministic."""
    loads = [0] * ranks
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        dealt[rank].append(index)
        loads[rank] += costs[index]
    return [sorted(indices) for indices in dealt]


# ---- layout: a planned micro-batch as tensors ----


@dataclass
class MicroBatch:
    indices: list[int]  # the samples, as indices into the update's list
    input_ids: torch.Tensor  # padded (B, P + C); padding-free (1, T)
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # None when padding-free: the position ids separate the sequences
    completion_ids: torch.Tensor  # (B, C)
    mask: torch.Tensor  # (B, C) bool: real completion tokens (tool tokens too: the layouts compute them)
    behavior_logprobs: torch.Tensor  # (B, C) float32: the generator's
    advantages: torch.Tensor  # (B,) float32
    # The PPO denominator (B, C): the generator's logprobs, or a corrected sample's rescored ones; the rows of
    # ``from_forward`` take the training forward's own (detached) logprobs instead.
    denominator: torch.Tensor
    from_forward: torch.Tensor  # (B,) bool
    model_mask: torch.Tensor  # (B, C) bool: ``mask`` without tool tokens: the tokens ratios count
    loss_mask: torch.Tensor  # (B, C) bool: ``model_mask`` without the rows left out of the loss
    logit_positions: torch.Tensor | None = None  # padding-free: row positions predicting each completion token
    weight: float = 1.0  # 0 for a rank's filler pass: it runs the collectives and adds nothing

    @property
    def padding_free(self) -> bool:
        return self.logit_positions is not None

    def completion_view(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-token values of the computed positions as the (B, C) view the loss reads (0 at padding).

        Padded: ``per_token`` is already (B, C). Padding-free: it is (1, K), the K completion tokens in
        sequence order, which is the row-major order of ``mask``'s True entries."""
        if not self.padding_free:
            return per_token
        view = per_token.new_zeros(self.mask.shape)
        return view.masked_scatter(self.mask, per_token.reshape(-1))


def collate(
    samples: list[TrainSample], indices: list[int], pad_id: int, device: torch.device, padding_free: bool = False
) -> MicroBatch:
    """The tensors of the micro-batch of ``samples[indices]`` in the chosen layout."""
    chosen = [samples[index] for index in indices]
    completion_width = max(max(len(s.completion_token_ids) for s in chosen), 1)
    # Padded Python rows, then one tensor each: per-row tensor writes cost more than the model on small batches.
    completions, mask, behavior = [], [], []
    for sample in chosen:
        right = completion_width - len(sample.completion_token_ids)
        completions.append([*sample.completion_token_ids] + [pad_id] * right)
        mask.append([True] * len(sample.completion_token_ids) + [False] * right)
        behavior.append(list(sample.behavior_logprobs) + [0.0] * right)
    behavior_tensor = torch.tensor(behavior, dtype=torch.float32).to(device)
    denominator = behavior_tensor  # the generator's, unless a corrected sample was rescored
    if any(sample.corrected and sample.old_logprobs is not None for sample in chosen):
        rows = [
            [*(s.old_logprobs if s.corrected and s.old_logprobs is not None else s.behavior_logprobs)]
            + [0.0] * (completion_width - len(s.completion_token_ids))
            for s in chosen
        ]
        denominator = torch.tensor(rows, dtype=torch.float32).to(device)
    mask_tensor = torch.tensor(mask, dtype=torch.bool)
    model_tensor = mask_tensor  # without agent samples the model's tokens are the real ones
    if any(s.completion_mask is not None for s in chosen):
        model_rows = [s.model_flags() + [False] * (completion_width - len(s.completion_token_ids)) for s in chosen]
        model_tensor = torch.tensor(model_rows, dtype=torch.bool)
    trained = torch.tensor([s.trained for s in chosen], dtype=torch.bool)
    common = {
        "indices": indices,
        "completion_ids": torch.tensor(completions, dtype=torch.long).to(device),
        "mask": mask_tensor.to(device),
        "behavior_logprobs": behavior_tensor,
        "advantages": torch.tensor([s.advantage for s in chosen], dtype=torch.float32, device=device),
        "denominator": denominator,
        "from_forward": torch.tensor([s.corrected and s.old_logprobs is None for s in chosen]).to(device),
        "model_mask": model_tensor.to(device),
        "loss_mask": (model_tensor & trained.unsqueeze(1)).to(device),
    }
    if padding_free:
        ids: list[int] = []
        positions: list[int] = []
        predicting: list[int] = []
        for sample in chosen:
            start, prompt = len(ids), len(sample.prompt_token_ids)
            ids += [*sample.prompt_token_ids, *sample.completion_token_ids]
            positions += range(sample.length)
            # Completion token j sits at start + prompt + j; the position before it predicts it.
            predicting += range(start + prompt - 1, start + prompt - 1 + len(sample.completion_token_ids))
        return MicroBatch(
            input_ids=torch.tensor([ids], dtype=torch.long).to(device),
            position_ids=torch.tensor([positions], dtype=torch.long).to(device),
            attention_mask=None,
            logit_positions=torch.tensor(predicting, dtype=torch.long).to(device),
            **common,
        )
    prompt_width = max(len(s.prompt_token_ids) for s in chosen)
    rows, attention = [], []
    for sample, completion in zip(chosen, completions, strict=True):
        left = prompt_width - len(sample.prompt_token_ids)
        real = sample.length
        rows.append([pad_id] * left + [*sample.prompt_token_ids] + completion)
        attention.append([0] * left + [1] * real + [0] * (completion_width - len(sample.completion_token_ids)))
    attention_mask = torch.tensor(attention, dtype=torch.long)
    positions_tensor = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return MicroBatch(
        input_ids=torch.tensor(rows, dtype=torch.long).to(device),
        attention_mask=attention_mask.to(device),
        position_ids=positions_tensor.to(device),
        **common,
    )
