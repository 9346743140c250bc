"""Evidence that GRPO learns, before any queue exists: synchronous steps on the toy task, on CPU."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from asyncgrpo.protocol.records import UpdateMetrics
from asyncgrpo.run.config import RunConfig
from asyncgrpo.run.datasets import repeat_digit_prompts
from worker.algo.advantages import task_advantages
from worker.algo.rewards import score_completions
from worker.generate.transformers_backend import sample_completions
from worker.model.policy import Policy
from worker.optimize.batch import TrainSample
from worker.optimize.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 80
PROMPTS_PER_STEP = 8
# The run defaults (learning rate 2e-3: 5e-3 with 16-token completions was unstable in this setup).
CONFIG = RunConfig()
CHANCE = 1 / 14  # one character in the 14-token vocabulary


def synchronous_grpo(
    base: Path,
    config: RunConfig,
    steps: int,
    seed: int = 0,
    *,
    logprob_noise: float = 0.0,
    corrected: bool = False,
    updates: list[UpdateMetrics] | None = None,
) -> list[float]:
    """Sample, score, compute group advantages, take one update; return the mean reward of each step.

    ``logprob_noise``: the std of Gaussian noise added to each sampled token's logprob, as a generator whose
    numerics differ from the trainer's (bf16 vLLM) reports them; ``corrected`` marks the samples for the
    generator-trainer correction. ``updates`` collects each update's metrics."""
    policy = Policy.load(str(base))
    trainer = Trainer.initial(policy, config)
    records = repeat_digit_prompts(256, seed=seed)
    rng = random.Random(seed)
    group_size = config.sampling.samples_per_prompt
    curve = []
    for step in range(steps):
        batch = rng.sample(records, PROMPTS_PER_STEP)
        prompt_ids = policy.encode_prompts([r["prompt"] for r in batch])
        rows = [ids for ids in prompt_ids for _ in range(group_size)]
        with torch.no_grad():
            tokens, logprobs, _ = sample_completions(
                trainer.model,
                rows,
                max_completion_length=config.sampling.max_completion_length,
                temperature=config.sampling.temperature,
                top_p=config.sampling.top_p,
                seed=seed * 100_000 + step,
                eos_token_id=policy.eos_token_id,
                pad_token_id=policy.pad_token_id,
                device=policy.device,
            )
        texts = [policy.tokenizer.decode(ids, skip_special_tokens=True) for ids in tokens]
        prompts = [r["prompt"] for r in batch for _ in range(group_size)]
        answers = [r["answer"] for r in batch for _ in range(group_size)]
        rewards, by_name = score_completions(config.rewards, prompts, texts, answers)
        table = [[by_name[reward.name][i] for reward in config.rewards] for i in range(len(texts))]
        weights = [reward.weight for reward in config.rewards]
        advantages = task_advantages(table, weights, group_size, scale_rewards=config.loss.scale_rewards)
        if logprob_noise:
            noise = torch.Generator().manual_seed(seed * 100_000 + step)
            logprobs = [
                (torch.tensor(values) + logprob_noise * torch.randn(len(values), generator=noise)).tolist()
                for values in logprobs
            ]
        samples = [
            TrainSample(rows[i], tokens[i], logprobs[i], advantages[i], version=step, corrected=corrected)
            for i in range(len(rows))
        ]
        metrics = trainer.step(samples)
        if updates is not None:
            updates.append(metrics)
        curve.append(sum(rewards) / len(rewards))
    return curve


def test_grpo_learns_the_toy_task(tiny_model_dir: Path) -> None:
    curve = synchronous_grpo(tiny_model_dir, CONFIG, STEPS)
    first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
    print("reward curve (mean of each 10 steps):", [round(sum(curve[i : i + 10]) / 10, 3) for i in range(0, STEPS, 10)])
    assert last >= 2 * first, f"mean reward went from {first:.3f} to only {last:.3f}"
    assert last >= 4 * CHANCE, f"mean reward {last:.3f} of the last 10 steps is not well above chance {CHANCE:.3f}"


def _rises(curve: list[float]) -> None:
    first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
    assert last >= 2 * first, f"mean reward went from {first:.3f} to only {last:.3f}"
    assert last >= 4 * CHANCE, f"mean reward {last:.3f} of the last 10 steps is not well above chance {CHANCE:.3f}"


def _with_loss(**options: object) -> RunConfig:
    return CONFIG.model_copy(update={"loss": CONFIG.loss.model_copy(update=options)})


# One run per loss family whose sign or scale differs from the clipped default: a sign error or a missing
# gradient path cannot hide behind the parity tests' fixed tensors.
@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "cispo", "epsilon_high": 5.0},
        {"loss_type": "sapo"},
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},  # GSPO
    ],
    ids=["cispo", "sapo", "gspo"],
)
def test_each_loss_family_learns_the_toy_task(tiny_model_dir: Path, options: dict[str, object]) -> None:
    _rises(synchronous_grpo(tiny_model_dir, _with_loss(**options), STEPS))


NOISE = 0.3  # per-token logprob noise: a sequence of 16 tokens drifts by about exp(N(0, 1.2))


def test_the_correction_reports_its_weights_and_learns_from_a_noisy_generator(tiny_model_dir: Path) -> None:
    updates: list[UpdateMetrics] = []
    curve = synchronous_grpo(tiny_model_dir, CONFIG, STEPS, logprob_noise=NOISE, corrected=True, updates=updates)
    _rises(curve)
    figures = [update.importance_sampling_ratio for update in updates]
    assert all(figure is not None for figure in figures)
    # The PPO denominator is the trainer's own forward: nothing is clipped at staleness 0 ...
    assert max(update.clip_region for update in updates) == 0.0
    assert all(update.ratio == pytest.approx(1.0, abs=1e-6) for update in updates)
    # ... and the generator's noise shows in the correction weights, whose default mode (sequence_mask, at
    # most 3) drops the sequences beyond the bound.
    first = figures[0]
    assert first is not None
    assert first.logp_difference_mean == pytest.approx(NOISE * (2 / math.pi) ** 0.5, rel=0.25)
    assert first.min < 0.9 and first.max > 1.1
    assert max(figure.max for figure in figures if figure) <= 3.0


def test_without_the_correction_a_noisy_generator_shows_as_clipping_at_staleness_zero(tiny_model_dir: Path) -> None:
    updates: list[UpdateMetrics] = []
    synchronous_grpo(tiny_model_dir, CONFIG, 10, logprob_noise=NOISE, updates=updates)
    assert all(update.importance_sampling_ratio is None for update in updates)
    # The bias: the ratio to the noisy logprobs is far from 1 on fresh samples, and clipping throws away
    # gradient that the correction keeps.
    assert min(update.clip_region for update in updates) > 0.1
    assert min(update.kl for update in updates) > 0.01
