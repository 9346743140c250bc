"""The exact text a worker feeds the model for a stored prompt record, and how to tokenize it.

Without a chat template the text is the record's ``prompt``, tokenized with the tokenizer's own special
tokens (a BOS where the model uses one), as before chats existed. With one (``dataset.chat_template = true``,
or a ``dataset.messages_column``) it is ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
tokenize=False)``: the chat (or the prompt as one user message), after ``dataset.system_prompt`` when the chat
has no system message of its own. A template writes its special tokens into the text itself (Llama's starts
with its BOS), so templated text is tokenized *without* adding special tokens again, which would double the
BOS; ``FedPrompts.add_special_tokens`` says which.

This text is what the length check (``model.max_prompt_length``) counts, what rewards receive as their
``prompt`` argument, and what the rollout header records (``RolloutExtra.prompts``). The tokenizer is the
generation backend's (``GenerationBackend.tokenizer``), so the worker templates exactly as it tokenizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import DatasetConfig

Message = dict[str, str]


class ChatTemplateMissing(ValueError):
    """The run asks for a chat template and the model's tokenizer has none."""


def chat_messages(record: Mapping[str, Any], dataset: DatasetConfig) -> list[Message]:
    """The chat a record stands for: its stored ``messages``, or its prompt as one user message; with
    ``dataset.system_prompt`` in front unless the chat starts with a system message of its own."""
    messages: list[Message] = list(record.get("messages") or [{"role": "user", "content": record["prompt"]}])
    if dataset.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": dataset.system_prompt})
    return messages


def fed_prompt_text(record: Mapping[str, Any], dataset: DatasetConfig, tokenizer: Any) -> str:
    """The text fed to the model for one stored prompt record (see the module docstring)."""
    if not dataset.chat_templated:
        return record["prompt"]
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
        raise ChatTemplateMissing(
            f"the run sets dataset.chat_template = true or dataset.messages_column, but the tokenizer of {name!r} "
            "has no chat template; use an instruct model (model.base), or set dataset.chat_template = false "
            "and leave dataset.messages_column unset"
        )
    text = tokenizer.apply_chat_template(chat_messages(record, dataset), add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned a {type(text).__name__}, not the text")
    return text


@dataclass(frozen=True)
class FedPrompts:
    """The fed texts of one task's prompts, by prompt index."""

    texts: dict[int, str]
    add_special_tokens: bool  # False for templated text: the template wrote its special tokens already

    def of(self, groups: Sequence[GroupRef]) -> list[str]:
        """The texts of ``groups``, in their order."""
        return [self.texts[group.prompt_index] for group in groups]


def fed_prompts(
    prompts: Sequence[Mapping[str, Any]], indices: Iterable[int], dataset: DatasetConfig, tokenizer: Any
) -> FedPrompts:
    """The fed text of each prompt index in ``indices`` that exists in ``prompts`` (others are left out: the
    job rejects them as out of range). Raises ChatTemplateMissing naming the config field."""
    in_range = [index for index in indices if 0 <= index < len(prompts)]
    texts = {index: fed_prompt_text(prompts[index], dataset, tokenizer) for index in in_range}
    return FedPrompts(texts=texts, add_special_tokens=not dataset.chat_templated)
