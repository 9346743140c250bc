"""A step's batch (worker/optimize/batch.py): micro-batch plans, the padding-free layout, dealing micro-batches
to ranks, and padding-free training equal to padded training on the tiny model (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import masking_utils

from asyncgrpo.protocol.records import RolloutExtra
from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import LossConfig, RunConfig
from tests.support.train_samples import capture_gradients, synthetic_samples
from worker.algo.rollout import Rollout, RolloutSample
from worker.model import attention as attention_module
from worker.model.attention import SEGMENT_ATTENTION
from worker.model.policy import Policy
from worker.optimize.batch import (
    TrainSample,
    build_train_samples,
    collate,
    deal_to_ranks,
    pack_padding_free,
    plan_micro_batches,
    positions_computed,
)
from worker.optimize.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-5


def _long_tailed(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(512, int(8 * rng.paretovariate(1.2))) for _ in range(count)]


def test_a_padding_free_plan_holds_every_sample_once_within_the_budget() -> None:
    lengths = _long_tailed(200, seed=1)
    plan = pack_padding_free(lengths, token_budget=600)
    assert sorted(index for row in plan for index in row) == list(range(len(lengths)))
    for row in plan:
        assert sum(lengths[i] for i in row) <= 600 or len(row) == 1
        assert row == sorted(row)
    assert pack_padding_free(lengths, token_budget=600) == plan  # deterministic
    assert pack_padding_free([700, 5], token_budget=600) == [[0], [1]]  # too long: alone


def test_padding_free_computes_no_padding_where_padded_computes_most_of_it() -> None:
    lengths = _long_tailed(256, seed=2)
    for padding_free in (False, True):
        plan = plan_micro_batches(lengths, 4096, padding_free)
        computed = sum(positions_computed([lengths[i] for i in row], padding_free) for row in plan)
        share = 1 - sum(lengths) / computed
        if padding_free:
            assert share == 0.0
        else:
            assert share > 0.0


def test_micro_batches_are_dealt_to_ranks_by_tokens() -> None:
    costs = [500, 40, 40, 40, 300, 200, 10]
    dealt = deal_to_ranks(costs, 2)
    assert sorted(i for indices in dealt for i in indices) == list(range(len(costs)))
    loads = [sum(costs[i] for i in indices) for indices in dealt]
    assert loads == [580, 550]  # largest first, each to the less loaded rank
    assert deal_to_ranks(costs, 2) == dealt
    # More ranks than micro-batches: some ranks get none (they run weight-0 filler passes).
    assert deal_to_ranks([5], 3) == [[0], [], []]


def test_the_padding_free_layout_predicts_each_completion_token_from_the_position_before_it() -> None:
    samples = [
        TrainSample([1, 2], [3, 4, 5], [-1.0] * 3, 0.5),
        TrainSample([6], [], [], 0.1),
        TrainSample([7], [8], [-2.0], -1.0),
    ]
    batch = collate(samples, [0, 1, 2], pad_id=0, device=torch.device("cpu"), padding_free=True)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 0, 1]]
    assert batch.attention_mask is None
    assert batch.logit_positions.tolist() == [1, 2, 3, 6]
    row = batch.input_ids[0]
    assert row[batch.logit_positions + 1].tolist() == batch.completion_ids[batch.mask].tolist()
    view = batch.completion_view(torch.tensor([[10.0, 11.0, 12.0, 13.0]]))
    assert view.tolist() == [[10.0, 11.0, 12.0], [0.0, 0.0, 0.0], [13.0, 0.0, 0.0]]


def _trainer(model: Path, padding_free: bool, loss_type: str) -> Trainer:
    config = RunConfig.model_validate(
        {
            "optimizer": {"micro_batch_tokens": 40, "padding_free": padding_free},
            "loss": {"loss_type": loss_type, "beta": 0.1},
            "sampling": {"temperature": 0.7},
        }
    )
    return Trainer.initial(Policy.load(str(model)), config)


def _as_conversations(samples: list[TrainSample]) -> None:
    """Every other sample of 3 tokens or more becomes an agent sample: its inner tokens a tool's answer, with a
    meaningless behaviour logprob."""
    for sample in samples[::2]:
        length = len(sample.completion_token_ids)
        if length >= 3:
            sample.completion_mask = [True] + [False] * (length - 2) + [True]
            first, last = sample.behavior_logprobs[0], sample.behavior_logprobs[-1]
            sample.behavior_logprobs = [first, *[-50.0] * (length - 2), last]


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "agent"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_padding_free_training_equals_padded_training(tiny_model_dir: Path, loss_type: str, masked: bool) -> None:
    """Loss, gradients, ratios, entropy, reference KL and rescoring, from the same (non-initial) weights; with
    agent samples (tool tokens in their completions) too."""
    source = _trainer(tiny_model_dir, padding_free=False, loss_type=loss_type)
    samples = synthetic_samples(source, 20, seed=7)
    if masked:
        _as_conversations(samples)
        assert any(s.completion_mask is not None for s in samples)
    source.step(samples)  # off the LoRA init, where B = 0 would hide the adapter
    files = source.version_files(1)
    padded, packed = (_trainer(tiny_model_dir, pf, loss_type) for pf in (False, True))
    for trainer in (padded, packed):
        trainer.load_version_files(files)
    for a, b in zip(padded.rescore(samples), packed.rescore(samples), strict=True):
        assert a == pytest.approx(b, abs=TOLERANCE)
    for a, b in zip(padded.rescore_ratio_sums(samples), packed.rescore_ratio_sums(samples), strict=True):
        assert a == pytest.approx(b, abs=TOLERANCE * 20)  # sums over up to 20 tokens
    gradients = [capture_gradients(padded), capture_gradients(packed)]
    one, other = padded.step(samples), packed.step(samples)
    for figure in ("loss", "ratio", "kl", "entropy", "kl_ref", "clip_region", "grad_norm"):
        assert getattr(other, figure) == pytest.approx(getattr(one, figure), abs=TOLERANCE), figure
    assert other.micro_batches < one.micro_batches  # the same budget holds more real tokens per row
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_model_that_attends_across_a_packed_row_trains_padded(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, attention: str
) -> None:
    """Padding-free is the default only where it is exact: the trainer checks the model at build time."""

    def trainer(padding_free: bool) -> Trainer:
        config = RunConfig.model_validate({"optimizer": {"micro_batch_tokens": 40, "padding_free": padding_free}})
        return Trainer.initial(Policy.load(str(tiny_model_dir), attn_implementation=attention), config)

    exact = trainer(padding_free=True)
    assert exact.padding_free
    if attention == "sdpa":  # the trainer's own per-sequence attention (worker.model.attention) is in use
        assert exact.policy.model.config._attn_implementation == SEGMENT_ATTENTION
        # ... and no longer sees where the sequences of a row start.
        monkeypatch.setattr(attention_module, "segments", lambda position_ids: [(0, int(position_ids.shape[0]))])
    else:  # transformers' mask: it no longer finds the sequences of a packed row
        monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    leaky = trainer(padding_free=True)
    assert not leaky.padding_free
    padded = trainer(padding_free=False)
    assert padded.policy.model.config._attn_implementation == attention
    samples = synthetic_samples(padded, 12, seed=2)
    assert leaky.step(samples).loss == pytest.approx(padded.step(samples).loss, abs=TOLERANCE)


def test_train_samples_carry_the_correction_and_the_truncation_mask_of_their_rollout() -> None:
    def rollout(sampler: str | None) -> Rollout:
        samples = [
            RolloutSample(0, [1, 2], [3, 4], [-0.5, -0.5], 1.0, 0.5, "length"),
            RolloutSample(0, [1, 2], [3, 9], [-0.5, -0.5], 0.0, -0.5, "stop"),
        ]
        groups = [GroupRef(group_id="t.0", prompt_index=0)]
        return Rollout("r", f"t-{sampler}", 0, "gen", groups, samples, extra=RolloutExtra(sampler=sampler))

    rollouts = [rollout("vllm"), rollout("transformers"), rollout(None)]
    default = LossConfig()
    samples, _ = build_train_samples(rollouts, default)
    # Unset, the correction applies to vLLM's rollouts only; a rollout written before samplers were recorded
    # is the transformers backend's.
    assert [s.corrected for s in samples] == [True, True, False, False, False, False]
    assert all(s.trained for s in samples)
    forced, _ = build_train_samples(rollouts, LossConfig(vllm_importance_sampling_correction=True))
    assert all(s.corrected for s in forced)
    off, _ = build_train_samples(rollouts, LossConfig(vllm_importance_sampling_correction=False))
    assert not any(s.corrected for s in off)
    masked, _ = build_train_samples(rollouts, LossConfig(mask_truncated_completions=True))
    assert [s.trained for s in masked] == [False, True] * 3
    assert all(s.old_logprobs is None for s in samples)  # rescoring fills them
