"""One dataset row -> one prompt record, the same way for prompt files and Hub datasets.

A prompt record is a dict ``{"prompt": str, "answer": str | None}``, plus ``"messages"`` (a list of
``{"role", "content"}``) when the dataset has a messages column. Records without messages keep the exact
shape (and bytes in ``prompts.jsonl``) of runs created before chats existed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from asyncgrpo.protocol.schemas import is_valid_unicode
from asyncgrpo.run.config import DatasetConfig


class ChatMessage(TypedDict):
    """One turn of a chat prompt, as ``apply_chat_template`` takes it."""

    role: str
    content: str


class PromptRecord(TypedDict):
    """One prompt of a run, as stored in ``prompts.jsonl``: the text (a chat's last user turn), its reference
    answer (None: the rewards need none) and, for a chat dataset, the whole chat the worker feeds."""

    prompt: str
    answer: str | None
    messages: NotRequired[list[ChatMessage]]
    environment: NotRequired[str]  # [agent] with named environments: which one the prompt's conversations use


class PromptFileError(ValueError):
    """A prompt source (file, Hub dataset or local dataset folder) that cannot be used; the message names
    the source, the row or column, and the config field to change."""


@dataclass(frozen=True)
class RecordSpec:
    """Which columns hold the prompt (or chat) and the answer, and how to cut the answer out."""

    prompt_column: str
    answer_column: str | None  # None: the dataset has no answers
    messages_column: str | None = None
    answer_pattern: str | None = None
    environment_column: str | None = None  # [agent] with named environments: the one each prompt uses

    @classmethod
    def of(cls, config: DatasetConfig) -> RecordSpec:
        return cls(
            config.prompt_column,
            config.answer_column or None,
            config.messages_column,
            config.answer_pattern,
            config.environment_column,
        )

    def required_columns(self) -> list[tuple[str, str]]:
        """(column, config field) pairs every row must have."""
        first = (self.messages_column, "dataset.messages_column") if self.messages_column else None
        columns = [first or (self.prompt_column, "dataset.prompt_column")]
        if self.answer_column is not None:
            columns.append((self.answer_column, "dataset.answer_column"))
        if self.environment_column is not None:
            columns.append((self.environment_column, "dataset.environment_column"))
        return columns

    def check_columns(self, source: str, present: list[str]) -> None:
        """Refuse a missing column up front, naming the columns present and the field to set."""
        for column, setting in self.required_columns():
            if column not in present:
                raise missing_column(source, "", column, setting, present)

    def record(self, source: str, where: str, row: dict[str, Any]) -> PromptRecord:
        for column, setting in self.required_columns():
            if column not in row:
                raise missing_column(source, f" {where}", column, setting, list(row))
        messages: list[ChatMessage] = []
        if self.messages_column:
            messages = _chat(source, where, row[self.messages_column], self.messages_column)
            # The last user turn, for people reading prompts.jsonl; the worker feeds the whole chat.
            prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
        else:
            prompt = row[self.prompt_column]
            if not isinstance(prompt, str) or not prompt.strip():
                raise PromptFileError(
                    f"{source} {where} has an empty or non-text prompt in column {self.prompt_column!r} "
                    f"({prompt!r}); fix or remove that row"
                )
        answer = None
        if self.answer_column is not None:
            value = row[self.answer_column]
            answer = None if value is None else self._extract(source, where, str(value))
        texts = [(self.messages_column or self.prompt_column, m["content"]) for m in messages]
        texts += [(self.messages_column or self.prompt_column, prompt), (self.answer_column, answer)]
        for column, text in texts:
            if text is not None and not is_valid_unicode(text):
                # A lone surrogate ("\ud800" escaped in JSON) cannot be stored as UTF-8 nor tokenised.
                raise PromptFileError(
                    f"{source} {where} column {column!r} holds an unpaired UTF-16 surrogate; fix or remove that row"
                )
        record = PromptRecord(prompt=prompt, answer=answer)
        if messages:
            record["messages"] = messages
        if self.environment_column is not None:
            environment = row[self.environment_column]
            if not isinstance(environment, str) or not environment:
                raise PromptFileError(
                    f"{source} {where} has no environment name in column {self.environment_column!r} "
                    f"({environment!r}); name one of agent.environment's environments in that row"
                )
            record["environment"] = environment
        return record

    def _extract(self, source: str, where: str, answer: str) -> str:
        if self.answer_pattern is None:
            return answer
        match = re.search(self.answer_pattern, answer)
        if match is None:
            raise PromptFileError(
                f"{source} {where}: dataset.answer_pattern {self.answer_pattern!r} does not match its answer "
                f"{answer[-200:]!r}; fix the pattern or remove that row"
            )
        return (match.group(1) if match.re.groups else match.group(0)).strip()


def missing_column(source: str, where: str, column: str, setting: str, present: list[str]) -> PromptFileError:
    names = ", ".join(repr(name) for name in present) or "none"
    hint = ' (or set it to "" if the data has no answers)' if setting == "dataset.answer_column" else ""
    return PromptFileError(
        f"{source}{where} has no column {column!r}; columns present: {names}. Set {setting} to one of them{hint}"
    )


def _chat(source: str, where: str, value: Any, column: str) -> list[ChatMessage]:
    """The chat as plain ``{"role", "content"}`` turns, without trailing assistant turns (a reference reply
    the model must not see)."""
    bad = PromptFileError(
        f"{source} {where} column {column!r} (dataset.messages_column) must hold a list of "
        f'{{"role": ..., "content": "text"}} messages, not {str(value)[:200]}'
    )
    if not isinstance(value, list):
        raise bad
    messages = []
    for message in value:
        if not isinstance(message, dict):
            raise bad
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise bad
        messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or not any(m["content"].strip() for m in messages):
        raise PromptFileError(
            f"{source} {where} column {column!r} has no message before the assistant's reply; fix or remove that row"
        )
    return messages
