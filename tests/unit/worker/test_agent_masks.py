"""Agent samples on the optimize side: a completion that holds tool tokens (``completion_mask`` False) trains,
rescores and counts over the model's tokens only (worker/optimize: batch, trainer, rescore, job), on the tiny
model in fp32."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncgrpo.protocol.records import StepTimings
from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import LossConfig, RunConfig
from tests.support.train_samples import capture_gradients
from worker.algo.grpo import token_logprobs_and_entropy
from worker.algo.rollout import Rollout, RolloutSample
from worker.model.policy import Policy
from worker.optimize.batch import TrainSample, build_train_samples, collate
from worker.optimize.job import RolloutUnusable, build_step_record, validate_rollout
from worker.optimize.rescore import RescorePlan, ratios_by_rollout, rescore_planned
from worker.optimize.trainer import Trainer, mean_ratio

pytestmark = pytest.mark.usefixtures("one_torch_thread")

M, T = True, False  # the model's token, a tool's token
# [a, b] + [t1, t2, t3] + [c, eos]: the model's turn, the tool's answer, the model's next turn.
CONVERSATION = [M, M, T, T, T, M, M]


def _trainer(model: Path, **optimizer: object) -> Trainer:
    config = RunConfig.model_validate({"optimizer": {"max_grad_norm": 1e6, **optimizer}})
    return Trainer.initial(Policy.load(str(model)), config)


def _conversations(trainer: Trainer, count: int, seed: int) -> list[TrainSample]:
    """Agent samples with known tool tokens (and one old-style sample without a mask), their behaviour
    logprobs the trainer's own at the model's tokens and 0.0 at the tools' (what the generator writes)."""
    rng = random.Random(seed)
    vocab = trainer.policy.tokenizer.get_vocab()
    digits = [vocab[d] for d in "0123456789"]
    tools = [vocab["="], *digits]  # the tiny vocabulary has little else: a tool's answer is any tokens
    samples = []
    for index in range(count):
        prompt = [rng.choice(digits) for _ in range(rng.randint(1, 3))] + [vocab["="]]
        a, b, c = (rng.choice(digits) for _ in range(3))
        completion = [a, b, *(rng.choice(tools) for _ in range(3)), c, trainer.policy.eos_token_id]
        mask = None if index == 0 else list(CONVERSATION)
        samples.append(TrainSample(prompt, completion, [0.0] * 7, rng.uniform(-1.5, 1.5), completion_mask=mask))
    for sample, logprobs in zip(samples, trainer.rescore(samples), strict=True):
        flags = sample.model_flags()
        sample.behavior_logprobs = [lp if model else 0.0 for lp, model in zip(logprobs, flags, strict=True)]
    return samples


def _with_tool_logprobs(samples: list[TrainSample], value: float) -> list[TrainSample]:
    """Copies whose tool tokens carry behaviour logprob ``value`` (meaningless: it must change nothing)."""
    return [
        TrainSample(
            s.prompt_token_ids,
            s.completion_token_ids,
            [lp if model else value for lp, model in zip(s.behavior_logprobs, s.model_flags(), strict=True)],
            s.advantage,
            completion_mask=s.completion_mask,
        )
        for s in samples
    ]


def test_collate_keeps_tool_tokens_as_context_and_out_of_the_loss() -> None:
    samples = [
        TrainSample([1, 2], [3, 4, 5, 6], [-1.0, 0.0, 0.0, -1.0], 0.5, completion_mask=[M, T, T, M]),
        TrainSample([7], [8, 9], [-2.0, -2.0], -1.0),
        TrainSample([7], [8, 9, 10], [-2.0, 0.0, -2.0], 1.0, trained=False, completion_mask=[M, T, M]),
    ]
    assert [s.model_tokens for s in samples] == [2, 2, 2]
    for padding_free in (False, True):
        batch = collate(samples, [0, 1, 2], pad_id=0, device=torch.device("cpu"), padding_free=padding_free)
        assert batch.mask.tolist() == [[M, M, M, M], [M, M, T, T], [M, M, M, T]]
        assert batch.model_mask.tolist() == [[M, T, T, M], [M, M, T, T], [M, T, M, T]]
        assert batch.loss_mask.tolist() == [[M, T, T, M], [M, M, T, T], [T, T, T, T]]
    # Padding-free: the tool tokens still sit in the row and are predicted (later tokens read them).
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 7, 8, 9, 10]]
    assert batch.logit_positions.tolist() == [1, 2, 3, 4, 6, 7, 9, 10, 11]
    with pytest.raises(ValueError, match="4 completion tokens but a mask of 3"):
        TrainSample([1], [3, 4, 5, 6], [0.0] * 4, 0.0, completion_mask=[M, T, M])


def test_train_samples_carry_their_rollout_samples_masks() -> None:
    samples = [
        RolloutSample(0, [1], [3, 4, 5], [-0.5, 0.0, -0.5], 1.0, 0.5, "stop", completion_mask=[M, T, M]),
        RolloutSample(0, [1], [3, 9], [-0.5, -0.5], 0.0, -0.5, "stop"),
    ]
    rollout = Rollout("r", "t", 0, "gen", [GroupRef(group_id="t.0", prompt_index=0)], samples)
    built, _ = build_train_samples([rollout], LossConfig())
    assert [s.completion_mask for s in built] == [[M, T, M], None]
    assert [s.model_tokens for s in built] == [2, 2]


def test_tool_tokens_change_nothing_in_the_loss_gradients_or_figures(tiny_model_dir: Path) -> None:
    """Garbage behaviour logprobs at the tool tokens leave the update as it is, and its figures are those of
    the model's tokens alone, computed here by hand from one forward."""
    trainers = [_trainer(tiny_model_dir) for _ in range(3)]
    samples = _conversations(trainers[0], 8, seed=11)
    noise = random.Random(5)
    for sample in samples:  # move the model's tokens off ratio 1, so clipping and KL have something to show
        sample.behavior_logprobs = [
            lp + noise.uniform(-0.6, 0.6) if model else lp
            for lp, model in zip(sample.behavior_logprobs, sample.model_flags(), strict=True)
        ]

    # The figures over the model's tokens, from the test's own mask (not the batch's).
    trainer = trainers[0]
    batch = collate(samples, list(range(len(samples))), trainer.policy.pad_token_id, trainer.policy.device)
    with torch.no_grad():
        logprobs, entropy = token_logprobs_and_entropy(trainer._completion_logits(batch), batch.completion_ids)
    logprobs, entropy = logprobs.cpu(), entropy.cpu()  # the trainer's device; the expected figures are on CPU
    model = torch.tensor([s.model_flags() for s in samples])
    behavior = torch.tensor([s.behavior_logprobs for s in samples])
    advantages = torch.tensor([s.advantage for s in samples]).unsqueeze(1).expand_as(model)
    ratio = torch.exp(logprobs - behavior)[model]
    log_ratio = (logprobs - behavior)[model]
    advantage = advantages[model]
    clipped = torch.clamp(ratio, 1 - 0.2, 1 + 0.28)
    low, high = (ratio < 0.8) & (advantage < 0), (ratio > 1.28) & (advantage > 0)
    expected = {
        "tokens": int(model.sum()),
        "ratio": float(ratio.mean()),
        "kl": float((torch.exp(-log_ratio) + log_ratio - 1).mean()),
        "entropy": float(entropy[model].mean()),
        "clip_low": float(low.float().mean()),
        "clip_high": float(high.float().mean()),
        "clip_region": float((low | high).float().mean()),
        "loss": float(-torch.min(ratio * advantage, clipped * advantage).mean()),  # dapo: token sum / tokens
    }
    assert expected["tokens"] == 1 * 7 + 7 * 4 and expected["clip_region"] > 0

    gradients = [capture_gradients(t) for t in trainers]
    figures = ("tokens", "ratio", "kl", "entropy", "clip_low", "clip_high", "clip_region", "loss", "grad_norm")
    results = []
    for t, tool_value in zip(trainers, (0.0, -50.0, 3.0), strict=True):
        metrics = t.step(_with_tool_logprobs(samples, tool_value))
        results.append({name: getattr(metrics, name) for name in figures})
    for name, value in expected.items():
        assert results[0][name] == pytest.approx(value, abs=1e-5), name
    for other in results[1:]:
        assert other == results[0]
    for other in gradients[1:]:
        for name, gradient in gradients[0].items():
            assert torch.equal(other[name], gradient), name


def test_a_batch_of_tool_tokens_only_has_nothing_to_train(tiny_model_dir: Path) -> None:
    trainer = _trainer(tiny_model_dir)
    sample = TrainSample([1, 2], [3, 4], [0.0, 0.0], 1.0, completion_mask=[T, T])
    with pytest.raises(ValueError, match="no completion tokens of the model to train on"):
        trainer.step([sample])


def test_rescoring_a_conversation_under_its_own_weights_gives_ratio_one(tiny_model_dir: Path) -> None:
    """The model's tokens carry the trainer's own logprobs, the tools' 0.0: every ratio over the model's tokens
    is exactly 1 (the tool tokens' would not be: their logprob under the model is not 0)."""
    trainer = _trainer(tiny_model_dir)
    samples = _conversations(trainer, 6, seed=3)
    count = len(samples)
    model_tokens = [s.model_tokens for s in samples]

    sums = trainer.rescore_ratio_sums(samples)
    for (ratio, log_ratio), tokens in zip(sums, model_tokens, strict=True):
        assert ratio / tokens == pytest.approx(1.0, abs=1e-5) and log_ratio == pytest.approx(0.0, abs=1e-5)
    ratios = ratios_by_rollout(samples, dict(enumerate(sums)), [0] * count, 1)
    assert ratios.mean[0] == pytest.approx(1.0, abs=1e-5) and ratios.geometric[0] == pytest.approx(1.0, abs=1e-5)

    behavior, rescored = [s.behavior_logprobs for s in samples], trainer.rescore(samples)
    assert mean_ratio(behavior, rescored, [s.completion_mask for s in samples]) == pytest.approx(1.0, abs=1e-5)
    assert abs(mean_ratio(behavior, rescored) - 1.0) > 0.1  # counting the tool tokens would flag the worker

    # The corrected path: per-token rescoring under the claimed version, its ratio sums over the model's tokens.
    for sample in samples[::2]:
        sample.corrected = True
    rollout = Rollout("r", "t", 0, "gen", [GroupRef(group_id="t.0", prompt_index=0)], [])
    plan = RescorePlan(separate={0: list(range(count))})
    planned = rescore_planned(trainer, None, "r", 0, [rollout], samples, plan)  # type: ignore[arg-type]
    for index, tokens in enumerate(model_tokens):
        assert planned[index][0] / tokens == pytest.approx(1.0, abs=1e-5), index
    assert all(len(s.old_logprobs or []) == 7 for s in samples[::2])

    # The training forward's own ratio sums, and its figures.
    metrics, step_sums = trainer.step_with_ratio_sums(
        [TrainSample(s.prompt_token_ids, s.completion_token_ids, s.behavior_logprobs, s.advantage,
                     completion_mask=s.completion_mask) for s in samples]
    )  # fmt: skip
    for (ratio, _), tokens in zip(step_sums, model_tokens, strict=True):
        assert ratio / tokens == pytest.approx(1.0, abs=1e-5)
    assert metrics.ratio == pytest.approx(1.0, abs=1e-5) and metrics.kl == pytest.approx(0.0, abs=1e-5)
    assert metrics.tokens == sum(model_tokens)


def test_the_step_record_counts_the_models_tokens_and_malformed_masks_are_refused() -> None:
    samples = [
        RolloutSample(0, [1], [3, 4, 5, 6, 7], [-0.5, 0.0, 0.0, 0.0, -0.5], 1.0, 0.5, "stop", completion_mask=[
            M, T, T, T, M,
        ]),
        RolloutSample(0, [1], [3, 9], [-0.5, -0.5], 0.0, -0.5, "length"),
    ]  # fmt: skip
    rollout = Rollout("r", "t", 0, "gen", [GroupRef(group_id="t.0", prompt_index=0)], samples)
    validate_rollout(rollout)
    record = build_step_record(
        run="r",
        step=1,
        base_version=0,
        worker_id="trainer",
        rollouts=[rollout],
        ratios=[None],
        flagged=[],
        updates=[],
        timings=StepTimings(),
    )
    assert record.tokens == 4 and record.completion_length_mean == 2.0
    assert record.truncated_fraction == 0.5
    samples[0].completion_mask = [M, T, M]
    with pytest.raises(RolloutUnusable, match="5 completion tokens but a mask of 3"):
        validate_rollout(rollout)
