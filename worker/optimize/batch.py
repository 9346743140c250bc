"""A step's samples as the trainer consumes them: ``TrainSample``, made from the claimed rollouts, split into
optimizer updates without cutting a group, and packed into micro-batches.

A batch is packed into micro-batches under ``optimizer.micro_batch_tokens`` padded tokens: samples sorted by
length, each micro-batch laid out as left-padded prompts followed by right-padded completions, so the logits
of all completion tokens are the last ``C + 1`` positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from worker.algo.rollout import Rollout


@dataclass
class TrainSample:
    """One completion to train on: tokens, the behaviour logprob of each completion token, its advantage."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behavior_logprobs: list[float]
    advantage: float
    version: int = 0  # the policy version that sampled it (for staleness bookkeeping; not used by the math)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a train sample needs at least one prompt token")
        if len(self.completion_token_ids) != len(self.behavior_logprobs):
            raise ValueError(
                f"a train sample has {len(self.completion_token_ids)} completion tokens but "
                f"{len(self.behavior_logprobs)} behaviour logprobs; they must align one to one"
            )

    @property
    def length(self) -> int:
        return len(self.prompt_token_ids) + len(self.completion_token_ids)


def pack_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``token_budget`` padded tokens (rows x longest).

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


@dataclass
class MicroBatch:
    indices: list[int]
    input_ids: torch.Tensor  # (B, P + C): left-padded prompts, then right-padded completions
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_ids: torch.Tensor  # (B, C)
    mask: torch.Tensor  # (B, C) bool: real completion tokens
    behavior_logprobs: torch.Tensor  # (B, C) float32
    advantages: torch.Tensor  # (B,) float32


def collate(samples: list[TrainSample], indices: list[int], pad_id: int, device: torch.device) -> MicroBatch:
    chosen = [samples[index] for index in indices]
    prompt_width = max(len(s.prompt_token_ids) for s in chosen)
    completion_width = max(max(len(s.completion_token_ids) for s in chosen), 1)
    # Padded Python rows, then one tensor each: per-row tensor writes cost more than the model on small batches.
    ids, attention, mask, behavior = [], [], [], []
    for sample in chosen:
        prompt, completion = sample.prompt_token_ids, sample.completion_token_ids
        left, right = prompt_width - len(prompt), completion_width - len(completion)
        ids.append([pad_id] * left + [*prompt, *completion] + [pad_id] * right)
        attention.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
        mask.append([True] * len(completion) + [False] * right)
        behavior.append(list(sample.behavior_logprobs) + [0.0] * right)
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention_mask = torch.tensor(attention, dtype=torch.long)
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return MicroBatch(
        indices=indices,
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=positions.to(device),
        completion_ids=input_ids[:, prompt_width:].to(device),
        mask=torch.tensor(mask, dtype=torch.bool).to(device),
        behavior_logprobs=torch.tensor(behavior, dtype=torch.float32).to(device),
        advantages=torch.tensor([s.advantage for s in chosen], dtype=torch.float32, device=device),
    )


def build_train_samples(rollouts: list[Rollout]) -> tuple[list[TrainSample], list[tuple[int, int]]]:
    """Flatten rollouts into train samples; also return each sample's (rollout index, group index)."""
    samples: list[TrainSample] = []
    keys: list[tuple[int, int]] = []
    for owner, rollout in enumerate(rollouts):
        for sample in rollout.samples:
            samples.append(
                TrainSample(
                    prompt_token_ids=sample.prompt_token_ids,
                    completion_token_ids=sample.completion_token_ids,
                    behavior_logprobs=sample.behavior_logprobs,
                    advantage=sample.advantage,
                    version=rollout.version,
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
