"""``[agent]``: multi-turn rollouts, where the model calls tools or acts in an environment before its answer.

The names are TRL's where TRL has one (``tools``, ``environment_factory`` as ``environment``,
``max_tool_calling_iterations``). The fields are checked for shape here; whether the tools and environments
import and expose typed, documented methods is checked by ``run create`` in a child process
(``worker.generate.tool_process``), since this package may not import user code into the proxy.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# "package.module:attribute", the form rewards use for user code.
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_ENVIRONMENT_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _import_path(value: str, field: str) -> str:
    if not _IMPORT_PATH.match(value):
        raise ValueError(f"{field}={value!r} is not 'package.module:name'; give the import path of the object")
    return value


class AgentConfig(BaseModel):
    """``[agent]``: present when rollouts are conversations with tools or environments (see the module docstring)."""

    # As every config section (config._Section): a misspelt field is an error, not an ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    tools: list[str] = Field(
        default_factory=list,
        description="TRL's `tools`: functions the model may call, as 'package.module:function', each with type "
        "hints and a Google-style docstring (its JSON schema is shown to the model through the chat template). "
        "They run in a child process of each generate worker, importable there as rewards are.",
    )
    environment: str | dict[str, str] | None = Field(
        None,
        description="TRL's `environment_factory`: 'package.module:Factory', called once per concurrent "
        "conversation; its instance's `reset()` (returns None or text appended to the last user message) starts "
        "each conversation, its public methods are tools, and an optional `get_reward()` owns the reward (a "
        "reward named after the factory, weight 1, next to [[rewards]]). Or a table of named factories, each "
        "prompt choosing one by dataset.environment_column.",
    )
    max_tool_calling_iterations: int | None = Field(
        None,
        ge=0,
        le=10_000,
        description="TRL's name: at most this many rounds of tool calls per conversation (unset: until the token "
        "budget, sampling.max_completion_length, is spent). A conversation that asks for more ends there.",
    )
    tool_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds one tool call may run; past it the tool process is killed and restarted, and the "
        "model sees an error observation (a counted tool failure).",
    )
    tool_processes: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Tool processes per generate worker, when there are environments: a task's group i runs its "
        "conversations in process i mod n, so a tool that hangs past tool_timeout_s or kills its process takes "
        "only the environments of the groups in that process with it (those groups are rejected as "
        "environment_lost; the others are submitted). Unset: one per group of a task (async.groups_per_task), "
        "a fault then costs one group. Standalone tools hold no state: with them alone, one process.",
    )
    max_turn_tokens: int | None = Field(
        None,
        ge=1,
        le=131072,
        description="At most this many tokens per model turn (unset: what is left of the conversation's budget, "
        "sampling.max_completion_length, which counts model and tool tokens alike, as TRL does).",
    )
    tool_call_format: Literal["hermes", "tokenizer"] = Field(
        "hermes",
        description="How tool calls are read from a model turn: 'hermes', <tool_call>{\"name\": ..., "
        "\"arguments\": {...}}</tool_call> (Qwen2.5, Qwen3, Hermes and the tiny agent model); 'tokenizer', "
        "the tokenizer's own response template (transformers' parse_response).",
    )

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[str]) -> list[str]:
        for index, path in enumerate(value):
            _import_path(path, f"agent.tools.{index}")
        if len(set(value)) != len(value):
            raise ValueError("a tool is listed more than once; list each once")
        return value

    @field_validator("environment")
    @classmethod
    def _environment(cls, value: str | dict[str, str] | None) -> str | dict[str, str] | None:
        if isinstance(value, str):
            return _import_path(value, "agent.environment")
        if isinstance(value, dict):
            if not value:
                raise ValueError("agent.environment is an empty table; name at least one environment, or remove it")
            for name, path in value.items():
                if not _ENVIRONMENT_NAME.match(name):
                    raise ValueError(f"agent.environment.{name}: use letters, digits, '.', '_' or '-' in its name")
                _import_path(path, f"agent.environment.{name}")
        return value

    @property
    def environments(self) -> dict[str | None, str]:
        """The environment factories by name (None: the one unnamed environment); empty without one."""
        if self.environment is None:
            return {}
        if isinstance(self.environment, str):
            return {None: self.environment}
        return dict(self.environment)

    @property
    def named_environments(self) -> bool:
        """Whether each prompt chooses its environment by name (dataset.environment_column)."""
        return isinstance(self.environment, dict)
