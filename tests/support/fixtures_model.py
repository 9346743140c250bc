"""The tiny offline model for tests: built once per session into the session's temp folder, never downloaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.model.tiny_model import ensure_tiny_model

    # ensure_tiny_model is idempotent, so a second registration of this fixture costs nothing.
    return ensure_tiny_model(seed=0, cache_dir=tmp_path_factory.getbasetemp() / "asyncgrpo-cache")


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """The tiny model's matrices are too small to gain from threads; on a busy 2-core machine they lose."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_tiny_reward_model(out_dir: Path, seed: int = 1) -> Path:
    """A tiny random-init reward model: a Qwen2 sequence-classification model with one label and its pad token
    set, saved with the tiny tokenizer (which has a chat template), in Hugging Face format."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from worker.model.tiny_model import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
        # Random-init heads start at std 0.02: widen the score head so scores differ visibly between texts.
        torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-reward-model"))


def random_adapter(base_dir: Path, out: Path, seed: int) -> Path:
    """A PEFT adapter folder whose LoRA B matrices are random (a fresh LoRA is a no-op): a policy of its own."""
    import torch

    from asyncgrpo.run.config import LoraConfig
    from worker.model.policy import Policy, wrap_with_lora
    from worker.optimize.trainer_state import adapter_files, write_adapter_folder

    model = wrap_with_lora(Policy.load(str(base_dir)), LoraConfig(), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return write_adapter_folder(adapter_files(model, base=str(base_dir)), out)
