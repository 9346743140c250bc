"""Logging for every asyncgrpo process (proxy and workers): structlog, configured once per process.

- JSON lines when the output is not a terminal (systemd, containers, log shippers), readable colourless
  console lines when a person watches a terminal. ``ASYNCGRPO_LOG_FORMAT=json|console`` forces one
  (read through ``asyncgrpo.protocol.settings.LogSettings``, like ``ASYNCGRPO_LOG_LEVEL``).
- Process-wide ids (role, worker id, run) given to ``configure_logging`` go on every line, from every thread;
  per-task ids (task, step, version) are bound with ``structlog.contextvars.bound_contextvars`` around a task
  or request and land on every line logged inside it.
- Lines from the standard library (Celery, uvicorn, httpx, botocore) go through the same renderer, so a
  process writes one uniform stream.

Call ``configure_logging`` first thing in a process, before Celery or uvicorn set up their own logging.
This module must stay free of torch and of ``worker`` imports: the proxy uses it.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import EventDict, Processor, WrappedLogger

LOG_FORMATS = ("auto", "json", "console")
LOG_FORMAT_ENV = "ASYNCGRPO_LOG_FORMAT"  # LogSettings.log_format
LOG_LEVEL_ENV = "ASYNCGRPO_LOG_LEVEL"  # LogSettings.log_level

# Libraries that log every HTTP call at INFO; one line per request is ours to write, not theirs.
_NOISY_LOGGERS = ("httpx", "httpcore", "botocore", "boto3", "urllib3", "s3transfer")


class LoggingConfigError(ValueError):
    """An unusable logging setting; the message names the variable and the accepted values."""


class _AsyncgrpoHandler(logging.StreamHandler):
    """The root handler configure_logging installs (its own class, so a later call can find its stream)."""


def _previous_stream() -> IO[str] | None:
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _AsyncgrpoHandler):
            return handler.stream
    return None


def _process_fields(fields: dict[str, Any]) -> Processor:
    """A processor that adds fixed fields to every line unless the line already sets them."""

    def add_fields(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        for key, value in fields.items():
            event_dict.setdefault(key, value)
        return event_dict

    return add_fields


def _resolve_format(log_format: str | None, stream: IO[str]) -> str:
    chosen = (log_format or "auto").lower()
    if chosen not in LOG_FORMATS:
        raise LoggingConfigError(f"{LOG_FORMAT_ENV}={chosen!r} is unknown; use one of {', '.join(LOG_FORMATS)}")
    if chosen == "auto":
        isatty = getattr(stream, "isatty", None)
        chosen = "console" if isatty is not None and isatty() else "json"
    return chosen


def _resolve_level(level: str | int | None) -> int:
    raw = level if level is not None else "INFO"
    if isinstance(raw, int):
        return raw
    resolved = logging.getLevelName(raw.upper())
    if not isinstance(resolved, int):
        raise LoggingConfigError(
            f"{LOG_LEVEL_ENV}={raw!r} is not a log level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    return resolved


def configure_logging(
    *,
    log_format: str | None = None,
    level: str | int | None = None,
    stream: IO[str] | None = None,
    **process_fields: Any,
) -> str:
    """Configure structlog and the standard library's root logger for this process.

    ``process_fields`` (e.g. ``role="generate", worker="host-1234", run="r1"``) are added to every line.
    Returns the format chosen ("json" or "console"). Calling it again replaces the earlier configuration
    and, unless ``stream`` is given, keeps writing where the first call did: by then Celery may have replaced
    ``sys.stdout`` with a proxy that logs what is printed, and writing log lines there would loop.
    """
    if stream is None:
        stream = _previous_stream() or sys.stdout
    chosen = _resolve_format(log_format, stream)
    numeric_level = _resolve_level(level)
    fields = {key: value for key, value in process_fields.items() if value is not None}

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        _process_fields(fields),
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Processor
    if chosen == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False, default=str)
        final: list[Processor] = [
            structlog.processors.StackInfoRenderer(),
            # Tracebacks without the frames' local variables: those hold bearer tokens, request bodies and
            # prompts, and walking them (structlog's default) costs a request handler its time.
            structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False)),
            renderer,
        ]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
        final = [structlog.processors.StackInfoRenderer(), renderer]

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = _AsyncgrpoHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric_level)
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(max(numeric_level, logging.WARNING))

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: loggers made at import time (module-level ``log = structlog.get_logger()``) must pick up
        # a configuration done later, and a second configure_logging call (tests) must take effect.
        cache_logger_on_first_use=False,
    )
    return chosen
