"""Reward models: a sequence-classification model as a reward (TRL's ``reward_funcs`` given a model id).

A ``[[rewards]]`` entry with ``model`` names a Hub id or a local folder holding a model that
``AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)`` loads. Its reward for a completion is
``logits[:, 0]`` of the text TRL's ``GRPOTrainer`` scores:

* by default ``prompt + completion``: the prompt text the worker fed the policy (chat-templated by the policy's
  tokenizer when ``dataset.chat_template`` is on) followed by the completion text;
* with ``chat_template = true``: the reward tokenizer's own chat template of the prompt's chat (its messages, or
  the prompt as one user message, after ``dataset.system_prompt``) followed by the completion as the assistant's
  message (``apply_chat_template(messages, tokenize=False)``, TRL's conversational path).

The text is tokenized as TRL does, without adding special tokens, padded on the right (so every real token keeps
the position it has alone, and a batch scores exactly as one text at a time), and, with ``max_length``, cut from
the left to its last ``max_length`` tokens (the completion and the end the score is read at stay). The model
reads the score at the last non-pad token, so its config's ``pad_token_id`` is set to the tokenizer's (the EOS
token when the tokenizer has no pad token), as TRL does.

A generate worker loads its run's reward models once, at start (``worker.process.runtime``), on its device and in
``model.dtype``; each task scores all its completions of a reward in batches of ``batch_size``. A model that
cannot be loaded is a ``RewardModelError`` naming the reward and the model: ``asyncgrpo run create`` refuses it
(``check_reward_models``: config and tokenizer), and a worker that cannot load it exits instead of failing tasks.

torch and transformers are imported inside the functions, so the command line can check a config on a machine
without them and say which extra is missing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from worker.model.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import torch

log = structlog.get_logger()

Message = Mapping[str, str]

TRAIN_EXTRA = "pip install 'asyncgrpo[train]'"


class RewardModelSpec(Protocol):
    """What this module reads of a ``[[rewards]]`` entry (``asyncgrpo.run.config.RewardConfig`` fits)."""

    name: str
    model: str | None
    tokenizer: str | None
    revision: str | None
    chat_template: bool
    batch_size: int
    max_length: int | None


class RewardModelError(ValueError):
    """A reward model (or its tokenizer) that cannot be loaded or used; the message names the reward and the model."""


def model_rewards(rewards: Iterable[RewardModelSpec]) -> list[RewardModelSpec]:
    """The entries of ``rewards`` that are reward models."""
    return [reward for reward in rewards if reward.model is not None]


def _where(reward: RewardModelSpec) -> str:
    revision = f" at revision {reward.revision!r}" if reward.revision else ""
    return f"reward {reward.name!r} (model {reward.model!r}{revision})"


def _tokenizer_source(reward: RewardModelSpec) -> tuple[str, str | None]:
    """Where the reward's tokenizer comes from, and its revision (the model's own only when it is the model's)."""
    assert reward.model is not None
    if reward.tokenizer is None:
        return reward.model, reward.revision
    return reward.tokenizer, None


def _transformers(reward: RewardModelSpec) -> Any:
    try:
        import transformers
    except ImportError as error:
        raise RewardModelError(
            f"{_where(reward)} needs transformers and torch, which are not installed here ({error}); {TRAIN_EXTRA}"
        ) from error
    return transformers


def _load_tokenizer(reward: RewardModelSpec) -> Any:
    _transformers(reward)  # a clear error where transformers is not installed
    source, revision = _tokenizer_source(reward)
    try:
        tokenizer = load_tokenizer(source, revision=revision)
    except Exception as error:  # a missing folder, a bad file, no network: all the same to the user
        raise RewardModelError(
            f"{_where(reward)}: cannot load its tokenizer from {source!r} ({type(error).__name__}: {error}); fix "
            "rewards[].tokenizer, or rewards[].model when the tokenizer is the model's own"
        ) from error
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise RewardModelError(
                f"{_where(reward)}: its tokenizer {source!r} has neither a pad nor an EOS token, so a batch cannot be "
                "padded; set rewards[].tokenizer to one that has"
            )
        tokenizer.pad_token = tokenizer.eos_token
    if reward.chat_template and not getattr(tokenizer, "chat_template", None):
        raise RewardModelError(
            f"{_where(reward)} sets chat_template = true, but its tokenizer {source!r} has no chat template; set "
            "rewards[].chat_template = false, or a tokenizer with a template"
        )
    # Right padding keeps every real token at the position it has alone; cutting from the left keeps the
    # completion, whose end is where the score is read.
    tokenizer.padding_side = "right"
    tokenizer.truncation_side = "left"
    return tokenizer


def _check_local_weights(reward: RewardModelSpec) -> None:
    assert reward.model is not None
    folder = Path(reward.model)
    if not folder.is_dir():
        return  # a Hub id
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        raise RewardModelError(
            f"{_where(reward)}: the folder holds no weights (*.safetensors or pytorch_model*.bin); point "
            "rewards[].model at a folder written by save_pretrained"
        )


def check_reward_model(reward: RewardModelSpec) -> None:
    """What ``run create`` checks of a reward model without loading its weights: its config is one that
    ``AutoModelForSequenceClassification`` builds, a local folder holds weights, and its tokenizer loads (with a
    chat template when the entry asks for one). Raises ``RewardModelError``."""
    transformers = _transformers(reward)
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    try:
        config = transformers.AutoConfig.from_pretrained(reward.model, revision=reward.revision)
    except Exception as error:
        raise RewardModelError(
            f"{_where(reward)}: cannot load its config ({type(error).__name__}: {error}); set rewards[].model to a "
            "Hugging Face Hub id or a folder in Hugging Face format (a relative folder is read from the config "
            "file's folder)"
        ) from error
    if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise RewardModelError(
            f"{_where(reward)}: its model type {config.model_type!r} has no sequence-classification head in "
            "transformers; use a reward model (AutoModelForSequenceClassification)"
        )
    _check_local_weights(reward)
    _load_tokenizer(reward)


def check_reward_models(rewards: Iterable[RewardModelSpec]) -> None:
    """``check_reward_model`` of each reward model in ``rewards`` (function rewards are left alone)."""
    for reward in model_rewards(rewards):
        check_reward_model(reward)


def check_reward_models_of(config_path: str | Path) -> None:
    """``check_reward_models`` of the run config at ``config_path`` (``[[rewards]]`` and ``[eval] rewards``), for
    ``run create`` and ``asyncgrpo local`` before anything is stored. A config that does not validate is left to
    ``create_run``, which names the field."""
    from asyncgrpo.run.config import ConfigError, load_run_config

    try:
        config = load_run_config(config_path)
    except ConfigError:
        return
    check_reward_models([*config.rewards, *config.eval.rewards])


@dataclass
class LoadedRewardModel:
    """One reward model and its tokenizer on a device, in eval mode, frozen."""

    model: Any
    tokenizer: Any
    device: torch.device

    @classmethod
    def load(cls, reward: RewardModelSpec, device: torch.device, dtype: torch.dtype) -> LoadedRewardModel:
        transformers = _transformers(reward)
        _check_local_weights(reward)
        tokenizer = _load_tokenizer(reward)
        try:
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                reward.model, num_labels=1, revision=reward.revision, dtype=dtype
            )
        except Exception as error:
            raise RewardModelError(
                f"{_where(reward)}: cannot load it as a sequence-classification model with one label "
                f"({type(error).__name__}: {error}); set rewards[].model to a reward model"
            ) from error
        # The score is read at the last non-pad token: the model must know the tokenizer's pad id (TRL does this).
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        model.to(device)
        model.eval()
        model.requires_grad_(False)
        return cls(model=model, tokenizer=tokenizer, device=device)


def scored_texts(
    reward: RewardModelSpec,
    tokenizer: Any,
    prompts: Sequence[str],
    chats: Sequence[Sequence[Message]],
    completions: Sequence[str],
) -> list[str]:
    """The text the model scores for each completion (see the module docstring); the lists are parallel."""
    if not reward.chat_template:
        return [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]
    texts = []
    for chat, completion in zip(chats, completions, strict=True):
        messages = [dict(message) for message in chat] + [{"role": "assistant", "content": completion}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        if not isinstance(text, str):
            raise RewardModelError(f"{_where(reward)}: apply_chat_template returned a {type(text).__name__}")
        texts.append(text)
    return texts


class RewardModels:
    """The reward models a generate worker holds, loaded once, keyed by what they load (model, tokenizer,
    revision): entries of ``[[rewards]]`` and ``[eval] rewards`` naming the same model share it."""

    def __init__(self, loaded: Mapping[tuple[str, str | None, str | None], LoadedRewardModel]) -> None:
        self._loaded = dict(loaded)

    @staticmethod
    def _key(reward: RewardModelSpec) -> tuple[str, str | None, str | None]:
        assert reward.model is not None
        return reward.model, reward.tokenizer, reward.revision

    @classmethod
    def load(cls, rewards: Iterable[RewardModelSpec], device: str, dtype: str) -> RewardModels:
        """Load every reward model of ``rewards`` on ``device`` (``ASYNCGRPO_DEVICE``: 'auto', 'cpu', 'cuda'...) in
        ``dtype`` (``model.dtype``). Raises ``RewardModelError`` naming the first that cannot be loaded."""
        specs = model_rewards(rewards)
        if not specs:
            return cls({})
        _transformers(specs[0])
        from worker.model.policy import resolve_device, resolve_dtype

        torch_device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
        loaded: dict[tuple[str, str | None, str | None], LoadedRewardModel] = {}
        for reward in specs:
            key = cls._key(reward)
            if key not in loaded:
                loaded[key] = LoadedRewardModel.load(reward, torch_device, torch_dtype)
                log.info(
                    "generate.reward_model_loaded", reward=reward.name, model=reward.model, device=str(torch_device)
                )
        return cls(loaded)

    def __len__(self) -> int:
        return len(self._loaded)

    def score(
        self,
        reward: RewardModelSpec,
        prompts: Sequence[str],
        chats: Sequence[Sequence[Message]],
        completions: Sequence[str],
    ) -> list[float]:
        """The model's score (``logits[:, 0]``) of each completion, in batches of ``reward.batch_size``; NaN and
        inf are returned as they are (the caller rejects the group)."""
        import torch

        try:
            loaded = self._loaded[self._key(reward)]
        except KeyError:
            raise RewardModelError(f"{_where(reward)} was not loaded by this worker at start") from None
        texts = scored_texts(reward, loaded.tokenizer, prompts, chats, completions)
        # Similar lengths together: less padding; the scores do not depend on the batch (right padding).
        order = sorted(range(len(texts)), key=lambda index: len(texts[index]))
        scores = [math.nan] * len(texts)
        truncate = reward.max_length is not None
        for start in range(0, len(order), reward.batch_size):
            chosen = order[start : start + reward.batch_size]
            inputs = loaded.tokenizer(
                [texts[index] for index in chosen],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
                truncation=truncate,
                max_length=reward.max_length if truncate else None,
            ).to(loaded.device)
            with torch.inference_mode():
                logits = loaded.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            for index, value in zip(chosen, logits[:, 0].float().cpu().tolist(), strict=True):
                scores[index] = float(value)
        return scores

    def score_groups(
        self,
        rewards: Iterable[RewardModelSpec],
        prompts: Sequence[str],
        chats: Sequence[Sequence[Message]],
        completions: Sequence[Sequence[str]],
    ) -> list[dict[str, list[float]]]:
        """Each reward model's scores of a task's completions, all at once, split back by group: entry g maps a
        reward's name to the scores of group g's completions. ``prompts`` and ``chats`` hold one entry per group,
        ``completions`` one list per group."""
        specs = model_rewards(rewards)
        by_group: list[dict[str, list[float]]] = [{} for _ in completions]
        if not specs:
            return by_group
        flat_prompts = [prompt for prompt, group in zip(prompts, completions, strict=True) for _ in group]
        flat_chats = [chat for chat, group in zip(chats, completions, strict=True) for _ in group]
        flat_completions = [completion for group in completions for completion in group]
        for reward in specs:
            values = self.score(reward, flat_prompts, flat_chats, flat_completions)
            start = 0
            for group_index, group in enumerate(completions):
                by_group[group_index][reward.name] = values[start : start + len(group)]
                start += len(group)
        return by_group
