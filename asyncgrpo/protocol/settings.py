"""Settings every asyncgrpo process reads from its environment (prefix ``ASYNCGRPO_``), on pydantic-settings.

One class per process role sits on ``CommonSettings``: ``proxy.api.settings.ProxySettings`` and
``worker.process.settings.WorkerSettings``. Library code that serves every role reads only its own small
section (``LogSettings``, ``StorageSettings``, ``CacheSettings``), so a bad value meant for another role does
not break it. These settings modules are the only code that reads the environment; README's environment
table is generated from their classes (``python scripts/config_reference.py --env``, kept equal by a test).

A variable's name is ``ASYNCGRPO_`` + the field name in capitals (a renamed field also reads its former variable,
named in its ``AliasChoices``: ``variables``); an empty value counts as unset. A bad value
raises ``SettingsError``, whose message names the variable, the value, what is wrong and what to set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "ASYNCGRPO_"


class SettingsError(ValueError):
    """An environment variable with an unusable value; the message names it and says what to set."""


def env_name(field: str) -> str:
    """The environment variable of a settings field: ``heartbeat_s`` -> ``ASYNCGRPO_HEARTBEAT_S``."""
    return ENV_PREFIX + field.upper()


def field_bounds(info: FieldInfo) -> str:
    """A field's bounds as text (``> 0, <= 3600``, a pattern), for error messages and README's table."""
    parts = []
    for item in info.metadata:
        for name, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "len >=")):
            value = getattr(item, name, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
        pattern = getattr(item, "pattern", None)
        if pattern is not None:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def shown_default(info: FieldInfo) -> str:
    """A field's default as documented: computed defaults (hostname, pid) show their recipe, not this host's."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "shown_default" in extra:
        return str(extra["shown_default"])
    if info.default_factory is not None:
        return str(info.default_factory())  # type: ignore[call-arg]
    return "unset" if info.default is None else str(info.default)


def variables(cls: type[BaseSettings]) -> dict[str, FieldInfo]:
    """Every environment variable ``cls`` reads, with its field: ``env_name`` of each field, or the variables its
    ``AliasChoices`` names (a renamed setting that still reads its former variable)."""
    read: dict[str, FieldInfo] = {}
    for field, info in cls.model_fields.items():
        alias = info.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias] if isinstance(alias, str) else []
        for choice in choices or [env_name(field)]:
            read[str(choice).upper()] = info
    return read


def _explain(cls: type[BaseSettings], error: ValidationError) -> str:
    lines = []
    read = variables(cls)
    for item in error.errors():
        field = str(item["loc"][0]) if item["loc"] else ""
        # pydantic names the field, or for an aliased one the variable it read.
        name = field.upper() if field.upper() in read else env_name(field)
        info = read.get(name)
        message = item["msg"].removeprefix("Value error, ")
        if info is None:
            lines.append(f"{name}: {message}")
            continue
        # Never echo a secret back into a log line.
        value = "<hidden>" if "SecretStr" in str(info.annotation) else repr(item.get("input"))
        meaning = (info.description or "").replace("\n", " ").rstrip(".")
        bounds = field_bounds(info)
        lines.append(
            f"{name}={value} is invalid: {message}. Set {name} ({meaning}"
            + (f"; {bounds}" if bounds else "")
            + f") or unset it for the default ({shown_default(info)})."
        )
    return "\n".join(lines)


class AsyncgrpoSettings(BaseSettings):
    """Base of every settings class: the ``ASYNCGRPO_`` prefix, field docstrings as help, readable errors."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
        # Unset and empty mean the same (``VAR=`` in an env file, ``VAR=`` in a systemd unit).
        env_ignore_empty=True,
        use_attribute_docstrings=True,
        frozen=True,
        validate_default=True,
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as error:
            # pydantic names the field (``heartbeat_s``); operators set variables, so name the variable.
            raise SettingsError(_explain(type(self), error)) from None


class LogSettings(AsyncgrpoSettings):
    """Logging, for every process (``asyncgrpo.protocol.log_setup`` checks the values and names the choices)."""

    log_format: str = "auto"
    """Log format: `auto` (JSON unless stdout is a terminal), `json` or `console`."""

    log_level: str = "INFO"
    """Log level: DEBUG, INFO, WARNING, ERROR or CRITICAL."""


class StorageSettings(AsyncgrpoSettings):
    """Where a run's objects live, for every process that opens the bucket."""

    bucket: str | None = Field(None, pattern=r"^(file|s3)://")
    """The run's bucket: `file:///abs/path` or `s3://bucket/prefix`."""

    s3_endpoint_url: str | None = Field(None, pattern=r"^https?://")
    """Endpoint of an S3-compatible store (SeaweedFS, MinIO, R2); unset for AWS S3. Credentials and region
    follow the standard AWS chain."""


class CacheSettings(AsyncgrpoSettings):
    """The local cache of a machine's worker processes and tools."""

    cache: Path = Path("~/.cache/asyncgrpo")
    """Local cache of adapters and of the tiny model (`~` is expanded)."""

    @field_validator("cache")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        # systemd does not expand ``~`` in an EnvironmentFile; do it here so both spellings work.
        return value.expanduser()


class CommonSettings(LogSettings, StorageSettings):
    """What the proxy and every worker share: Redis, the bucket, the token, the run, logging."""

    redis_url: str = Field("redis://127.0.0.1:6379/0", pattern=r"^(redis|rediss|unix)://")
    """Redis: the proxy's state and the Celery broker."""

    token: SecretStr | None = None
    """Bearer token shared by the proxy and its workers; the proxy refuses to start without one unless
    `--insecure-loopback` is given with a loopback host."""

    run: str | None = Field(None, min_length=1)
    """The run: the proxy coordinates it (its `--run` overrides it); a worker consumes only its Celery queues
    (required by workers)."""

    def token_value(self) -> str | None:
        """The token as text, for the one place that sends or checks it."""
        return self.token.get_secret_value() if self.token is not None else None
