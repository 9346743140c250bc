"""The run config's ``[[rewards]]`` entries: a reward function by name, or a reward model (``model``).

Its own module because reward models brought a table of their own: which fields apply to which kind, the name a
reward model gets when its entry names none, and how a reward model's folder relative to the config file is read.
``asyncgrpo.run.config`` re-exports what it used to define here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# The built-in rewards of ``worker.algo.rewards`` (a test keeps the two lists equal; the proxy never imports
# worker code), and those that score against the dataset's reference answer.
BUILTIN_REWARD_NAMES = ("exact_match", "format", "math_verify", "repeat_digit")
REWARDS_NEEDING_ANSWER = frozenset({"exact_match", "math_verify"})
_USER_REWARD = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


REWARD_CHOICES = f"a built-in ({', '.join(BUILTIN_REWARD_NAMES)}) or 'package.module:function' for your own"


class RewardConfig(BaseModel):
    """One ``[[rewards]]`` entry: a reward function by name, or a reward model (``model``)."""

    # As every config section (config._Section): a misspelt field is an error, not an ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        None,
        min_length=1,
        description="A reward model instead of a function (TRL's reward_funcs given a model id): a Hugging Face "
        "Hub id or a local folder (relative to the config file; the same path on every generate worker) loaded "
        "with AutoModelForSequenceClassification (num_labels=1) by each generate worker at start, on its "
        "device in model.dtype. Its reward is logits[:, 0] of prompt + completion. `run create` refuses one "
        "whose config or tokenizer does not load. Needs transformers (pip install 'asyncgrpo[train]').",
    )
    name: str = Field(
        ...,
        min_length=1,
        description="A built-in reward ('repeat_digit', 'exact_match', 'format', 'math_verify') or "
        "'package.module:function' for user code. With `model`: the name the model's scores are reported under "
        "(letters, digits, '.', '_', '-'; default: the last component of `model`). Each name once.",
    )
    weight: float = Field(1.0, ge=-1000, le=1000, description="Weight of this reward in the total.")
    tokenizer: str | None = Field(
        None,
        min_length=1,
        description="With `model`: the reward model's tokenizer, a Hub id or a folder relative to the config "
        "file (default: the model's own).",
    )
    revision: str | None = Field(
        None,
        min_length=1,
        description="With `model`: pin a Hub model (and its own tokenizer) to this commit, tag or branch.",
    )
    chat_template: bool = Field(
        False,
        description="With `model`: score the reward tokenizer's chat template of the prompt's chat (the "
        "prompt as a user message, after dataset.system_prompt) and the completion as the assistant's message, "
        "instead of prompt + completion.",
    )
    batch_size: int = Field(
        16, ge=1, le=4096, description="With `model`: completions per forward pass of the reward model."
    )
    max_length: int | None = Field(
        None,
        ge=1,
        le=131072,
        description="With `model`: keep only the last max_length tokens of each scored text (default: all).",
    )

    @model_validator(mode="before")
    @classmethod
    def _name_of_model(cls, data: object) -> object:
        if isinstance(data, dict) and not data.get("name"):
            model = data.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(
                    "set `name` to a built-in reward or 'package.module:function', or `model` to a reward model"
                )
            return {**data, "name": reward_model_name(model)}
        return data

    @field_validator("name")
    @classmethod
    def _known_or_importable_path(cls, value: str, info: ValidationInfo) -> str:
        # Only the spelling here: whether a 'module:function' imports is checked by `run create`, not by every
        # process that reads the stored config. (`model` is declared first so that it is known here.)
        if info.data.get("model") is None and value not in BUILTIN_REWARD_NAMES and not _USER_REWARD.match(value):
            raise ValueError(f"reward {value!r} is unknown; use {REWARD_CHOICES}, or set `model` for a reward model")
        return value

    @model_validator(mode="after")
    def _function_or_model(self) -> RewardConfig:
        if self.model is None:
            # Set to other than its default: a stored or dumped entry spells the defaults out.
            fields = type(self).model_fields
            model_only = sorted(name for name in _MODEL_ONLY_FIELDS if getattr(self, name) != fields[name].default)
            if model_only:
                raise ValueError(
                    f"{model_only[0]} applies to a reward model only; set `model` too, or remove {model_only[0]}"
                )
            return self
        if not _MODEL_REWARD_NAME.match(self.name):
            raise ValueError(
                f"name={self.name!r}: a reward model's name is letters, digits, '.', '_' and '-' (at most 64, "
                "starting with a letter or digit); set `name`"
            )
        if self.name in BUILTIN_REWARD_NAMES:
            raise ValueError(f"name={self.name!r} is a built-in reward's; name the reward model otherwise")
        return self

    def stored(self) -> dict[str, object]:
        """The entry as ``config.json`` stores it: a function reward as it was before reward models existed (name
        and weight), so old runs' config.json, and its sha256 that a resumed `asyncgrpo local` compares, stay
        the same."""
        data = self.model_dump(mode="json")
        if self.model is None:
            return {"name": data["name"], "weight": data["weight"]}
        return data


_MODEL_ONLY_FIELDS = ("tokenizer", "revision", "chat_template", "batch_size", "max_length")
_MODEL_REWARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def reward_model_name(model: str) -> str:
    """The name a reward model's entry gets when it names none: the last component of its Hub id or folder,
    with anything but letters, digits, '.', '_' and '-' replaced by '_'."""
    last = model.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", last).lstrip("._-")[:64]
    return name or "reward_model"


def resolve_reward_folders(data: dict, base_dir: Path) -> dict:
    """``data`` (a parsed TOML run config) with each reward model's and tokenizer's local folder made absolute:
    a relative folder is read from the config file's folder (``base_dir``), like ``dataset.path``. A value is a
    folder when it starts with '.', '/' or '~', or when it exists there; anything else is left as a Hub id."""

    def resolved(value: object) -> object:
        if not isinstance(value, str) or not value:
            return value
        path = Path(value).expanduser()
        if path.is_absolute():
            return str(path)
        candidate = base_dir / path
        if value.startswith(".") or candidate.exists():
            return os.path.abspath(candidate)  # not resolve(): a linked folder keeps its own name
        return value

    def entries(rewards: object) -> object:
        if not isinstance(rewards, list):
            return rewards
        return [
            {**entry, **{key: resolved(entry[key]) for key in ("model", "tokenizer") if key in entry}}
            if isinstance(entry, dict)
            else entry
            for entry in rewards
        ]

    out = dict(data)
    if "rewards" in out:
        out["rewards"] = entries(out["rewards"])
    if isinstance(out.get("eval"), dict) and "rewards" in out["eval"]:
        out["eval"] = {**out["eval"], "rewards": entries(out["eval"]["rewards"])}
    return out
