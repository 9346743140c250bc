"""Resuming a trainer from its version files continues bit-identically (CPU, fixed seed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncgrpo.bucket.layout import ADAPTER_WEIGHTS_NAME
from asyncgrpo.run.config import RunConfig
from tests.support.train_samples import synthetic_samples
from worker.model.policy import Policy
from worker.optimize.trainer import Trainer
from worker.optimize.trainer_state import load_adapter_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Dropout draws from the trainer's RNG, warmup + cosine depend on the update count, small micro-batches
# split each step: everything a resume must restore is in play.
CONFIG = RunConfig.model_validate(
    {
        "seed": 7,
        "lora": {"dropout": 0.1},
        "optimizer": {"warmup_steps": 2, "lr_schedule": "cosine", "total_steps": 6, "micro_batch_tokens": 40},
    }
)


def fresh_trainer(base: Path) -> Trainer:
    return Trainer.initial(Policy.load(str(base)), CONFIG)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in zip(trainer.param_names, trainer.lora_parameters, strict=True)}


def test_resume_is_bit_identical(tiny_model_dir: Path) -> None:
    uninterrupted = fresh_trainer(tiny_model_dir)
    batches = [synthetic_samples(uninterrupted, 10, seed=seed) for seed in range(4)]
    uninterrupted.step(batches[0])
    uninterrupted.step(batches[1])
    saved = uninterrupted.version_files(2)
    uninterrupted.step(batches[2])
    uninterrupted.step(batches[3])

    resumed = fresh_trainer(tiny_model_dir)  # a new process would start exactly like this
    assert resumed.load_version_files(saved) == 2
    assert resumed.updates == 2
    resumed.step(batches[2])
    resumed.step(batches[3])

    expected, actual = weights(uninterrupted), weights(resumed)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    # The next version's files are byte for byte the same too (weights, moments, step counts, RNG).
    assert resumed.version_files(4) == uninterrupted.version_files(4)


def test_restoring_only_the_adapter_is_not_enough(tiny_model_dir: Path) -> None:
    """The check above can fail: without optimizer moments, update count and RNG the result differs."""
    uninterrupted = fresh_trainer(tiny_model_dir)
    batches = [synthetic_samples(uninterrupted, 10, seed=seed) for seed in range(2)]
    uninterrupted.step(batches[0])
    saved = uninterrupted.version_files(1)
    uninterrupted.step(batches[1])

    weights_only = fresh_trainer(tiny_model_dir)
    load_adapter_weights(weights_only.model, saved[ADAPTER_WEIGHTS_NAME])
    weights_only.step(batches[1])
    expected, actual = weights(uninterrupted), weights(weights_only)
    assert not all(torch.equal(actual[name], expected[name]) for name in expected)


def test_loading_an_older_version_discards_newer_state(tiny_model_dir: Path) -> None:
    """A worker whose memory is ahead (a lost CAS, a redelivered step) goes back to version 0 exactly."""
    reference = fresh_trainer(tiny_model_dir)
    version_zero = reference.version_files(0)
    batch = synthetic_samples(reference, 10, seed=0)
    reference.step(batch)

    ahead = fresh_trainer(tiny_model_dir)
    ahead.step(synthetic_samples(ahead, 10, seed=9))
    ahead.step(synthetic_samples(ahead, 10, seed=8))
    assert ahead.load_version_files(version_zero) == 0
    assert ahead.updates == 0 and not ahead.optimizer.state
    ahead.step(batch)
    expected, actual = weights(reference), weights(ahead)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
