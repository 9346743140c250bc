"""Synthetic training samples for trainer tests (random digit prompts and completions on the tiny model), and
the gradients a trainer is about to apply."""

from __future__ import annotations

import random

import torch

from worker.optimize.batch import TrainSample
from worker.optimize.trainer import Trainer


def synthetic_samples(trainer: Trainer, count: int, seed: int) -> list[TrainSample]:
    """Behaviour logprobs come from the trainer itself, so the importance ratio starts at 1."""
    rng = random.Random(seed)
    vocab = trainer.policy.tokenizer.get_vocab()
    digits = [vocab[d] for d in "0123456789"]
    samples = []
    for _ in range(count):
        prompt = [rng.choice(digits) for _ in range(rng.randint(1, 3))] + [vocab["="]]
        completion = [rng.choice(digits) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.5:
            completion.append(trainer.policy.eos_token_id)
        samples.append(TrainSample(prompt, completion, [0.0] * len(completion), rng.uniform(-1.5, 1.5)))
    for sample, logprobs in zip(samples, trainer.rescore(samples), strict=True):
        sample.behavior_logprobs = logprobs
    return samples


def capture_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Record the (clipped) gradients the optimizer is about to apply, at each step."""
    gradients: dict[str, torch.Tensor] = {}
    apply = trainer.optimizer.step

    def recording_step(*args: object, **kwargs: object) -> object:
        for name, parameter in zip(trainer.param_names, trainer.lora_parameters, strict=True):
            gradients[name] = parameter.grad.detach().clone()
        return apply(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return gradients
