"""The run config's ``[dataset]`` table: where prompts come from and how workers feed them to the model.

Its own module because the table is large; ``asyncgrpo.run.config`` re-exports ``DatasetConfig``, and the
``[eval.dataset]`` table reuses it.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class DatasetConfig(BaseModel):
    """Where the prompts come from: exactly one of ``path``, ``hub_id`` or ``generator``. Loaded once, by
    ``run create``, and frozen into the run's ``prompts.jsonl``; workers never read the source."""

    # As every config section (config._Section): a misspelt field is an error, not an ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = Field(
        None,
        description="Prompt file (.jsonl, .json, .csv or .parquet), relative to the config file. Set only one of "
        "`path`, `hub_id`, `generator`.",
    )
    hub_id: str | None = Field(
        None,
        description="A Hugging Face Hub dataset id (e.g. 'openai/gsm8k'), or a local folder: one written by "
        "`save_to_disk`, or a folder of parquet/arrow/json/csv files. Loaded with the `datasets` library "
        "(pip install 'asyncgrpo[hub]').",
    )
    subset: str | None = Field(None, description="The dataset's config name on the Hub (e.g. 'main' for gsm8k).")
    split: str = Field("train", min_length=1, description="The split of `hub_id` to use.")
    revision: str | None = Field(
        None, description="Pin `hub_id` to this Hub commit, tag or branch (default: the latest)."
    )
    generator: str | None = Field(
        "repeat_digit",
        description="Name of a built-in prompt generator (e.g. 'repeat_digit'), used when neither `path` nor "
        "`hub_id` is set.",
    )
    num_prompts: int = Field(
        512, ge=1, le=10_000_000, description="How many prompts the generator makes (ignored with `path`/`hub_id`)."
    )
    max_rows: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Use only the first max_rows rows of `path` or of the `hub_id` split (default: all).",
    )
    prompt_column: str = Field("prompt", min_length=1, description="Column holding the prompt text.")
    answer_column: str | None = Field(
        "answer", description="Column holding the reference answer passed to rewards (may be empty)."
    )
    answer_pattern: str | None = Field(
        None,
        description="Regular expression that extracts the reference answer from the answer column: its first "
        "group (or the whole match), stripped; a row it does not match is an error. E.g. '####\\s*(.+)' for "
        "gsm8k's '... #### 42'.",
    )
    messages_column: str | None = Field(
        None,
        description="Column holding a chat, a list of {role, content}, used as the prompt instead of "
        "`prompt_column` with the tokenizer's chat template; trailing assistant turns (a reference reply) are "
        "dropped.",
    )
    chat_template: bool = Field(
        False,
        description="Wrap each prompt as one user message and apply the tokenizer's chat template with the "
        "generation prompt (for instruct models). The templated text is what rollouts record.",
    )
    system_prompt: str | None = Field(
        None,
        description="System message put before each chat when templating (not when the chat has its own). "
        "Needs `chat_template` or `messages_column`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _generator_only_by_default(cls, data: object) -> object:
        # The generator applies only when no other source is named, so a config with `path` or `hub_id` need not
        # also write `generator = ""`; and runs stored before `hub_id` existed (their config.json spells the
        # default generator next to `path`) keep loading as they did.
        if isinstance(data, dict) and (data.get("path") or data.get("hub_id")):
            return {**data, "generator": None}
        return data

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            pattern = re.compile(value)
        except re.error as error:
            raise ValueError(f"{value!r} is not a valid regular expression: {error}") from None
        if pattern.groups > 1:
            raise ValueError(f"{value!r} has {pattern.groups} groups; use at most one, around the answer")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        sources = [name for name in ("path", "hub_id", "generator") if getattr(self, name)]
        if not sources:
            raise ValueError(
                "set dataset.path to a prompt file, dataset.hub_id to a Hub dataset (or a local dataset folder), "
                "or dataset.generator to a built-in generator"
            )
        if len(sources) > 1:
            named = " and ".join(f"dataset.{name}" for name in sources)
            raise ValueError(f"{named} are all set; set only one source of prompts")
        if self.system_prompt is not None and not self.chat_templated:
            raise ValueError(
                "dataset.system_prompt is only used with a chat template: set dataset.chat_template = true "
                "or dataset.messages_column"
            )
        hub_only = [name for name in ("subset", "revision") if getattr(self, name) is not None]
        if hub_only and not self.hub_id:
            raise ValueError(f"dataset.{hub_only[0]} applies to dataset.hub_id only; set hub_id or remove it")
        return self

    @property
    def chat_templated(self) -> bool:
        """Whether workers feed prompts through the tokenizer's chat template."""
        return self.chat_template or self.messages_column is not None
