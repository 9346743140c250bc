"""configure_logging: JSON off a terminal, console on one; process and task ids on every line, any thread."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator

import pytest
import structlog

from asyncgrpo.protocol.log_setup import LoggingConfigError, configure_logging
from asyncgrpo.protocol.settings import LogSettings


class TerminalStream(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """configure_logging changes process-wide state; put back what pytest and other tests rely on."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    saved = structlog.get_config()
    yield
    root.handlers, root.level = handlers, level
    structlog.reset_defaults()
    structlog.configure(**saved)


def json_lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_process_and_task_ids_from_every_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCGRPO_LOG_FORMAT", raising=False)
    stream = io.StringIO()
    assert configure_logging(stream=stream, role="generate", worker="host-1-generate-0", run="r1") == "json"
    log = structlog.get_logger()
    with structlog.contextvars.bound_contextvars(task_id="gen-r1-0-00000007", version=12):
        log.info("generate.task_done", seconds=1.25)
        logging.getLogger("celery.worker").warning("celery says %s", "hello")
    thread = threading.Thread(target=lambda: log.warning("heartbeat failed", error="timeout"))
    thread.start()
    thread.join()
    log.debug("hidden at INFO")

    task_line, celery_line, thread_line = json_lines(stream)
    assert task_line["event"] == "generate.task_done" and task_line["level"] == "info"
    assert task_line["task_id"] == "gen-r1-0-00000007" and task_line["version"] == 12 and task_line["seconds"] == 1.25
    assert celery_line["event"] == "celery says hello" and celery_line["logger"] == "celery.worker"
    assert celery_line["task_id"] == "gen-r1-0-00000007" and celery_line["level"] == "warning"
    assert "task_id" not in thread_line  # a task's ids stay with the task...
    for line in (task_line, celery_line, thread_line):  # ...the process's ids are everywhere
        assert (line["role"], line["worker"], line["run"]) == ("generate", "host-1-generate-0", "r1")
        assert line["timestamp"].endswith("Z")


def from_environment() -> dict[str, str]:
    """What a process's entry passes: its settings' log format and level (``ASYNCGRPO_LOG_*``)."""
    settings = LogSettings()
    return {"log_format": settings.log_format, "level": settings.log_level}


def test_console_on_a_terminal_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCGRPO_LOG_FORMAT", raising=False)
    terminal = TerminalStream()
    assert configure_logging(stream=terminal, role="proxy") == "console"
    structlog.get_logger().info("proxy.starting", port=8700)
    text = terminal.getvalue()
    assert "proxy.starting" in text and "port=8700" in text and "role=proxy" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])

    monkeypatch.setenv("ASYNCGRPO_LOG_FORMAT", "json")
    assert configure_logging(**from_environment(), stream=TerminalStream()) == "json"
    monkeypatch.setenv("ASYNCGRPO_LOG_LEVEL", "WARNING")
    quiet = io.StringIO()
    configure_logging(**from_environment(), stream=quiet)
    structlog.get_logger().info("not shown")
    structlog.get_logger().error("shown")
    assert [line["event"] for line in json_lines(quiet)] == ["shown"]


def test_bad_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCGRPO_LOG_FORMAT", "xml")
    with pytest.raises(LoggingConfigError, match="ASYNCGRPO_LOG_FORMAT='xml' is unknown; use one of auto, json"):
        configure_logging(**from_environment(), stream=io.StringIO())
    monkeypatch.setenv("ASYNCGRPO_LOG_FORMAT", "json")
    monkeypatch.setenv("ASYNCGRPO_LOG_LEVEL", "LOUD")
    with pytest.raises(LoggingConfigError, match="ASYNCGRPO_LOG_LEVEL='LOUD' is not a log level"):
        configure_logging(**from_environment(), stream=io.StringIO())


def test_a_second_call_keeps_the_first_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCGRPO_LOG_FORMAT", "json")
    first = io.StringIO()
    configure_logging(stream=first, role="generate")
    # Celery's worker replaces sys.stdout with a logging proxy after set-up; the worker then adds its id.
    replaced = io.StringIO()
    monkeypatch.setattr("sys.stdout", replaced)
    configure_logging(role="generate", worker="w-7")
    structlog.get_logger().info("worker ready")
    assert replaced.getvalue() == ""
    (line,) = json_lines(first)
    assert line["worker"] == "w-7" and line["event"] == "worker ready"


@pytest.mark.parametrize("log_format", ["json", "console"])
def test_a_logged_traceback_names_the_error_but_not_the_frames_locals(
    monkeypatch: pytest.MonkeyPatch, log_format: str
) -> None:
    # A request handler's locals hold the bearer token and the request body: they never reach the log.
    monkeypatch.delenv("ASYNCGRPO_LOG_FORMAT", raising=False)
    stream = io.StringIO()
    configure_logging(stream=stream, log_format=log_format, role="proxy")

    secret, private = "-".join(["secret", "token", "0123456789abcdef"]), " ".join(["private", "prompt"])

    def handler(token: str) -> None:
        body = {"prompt": private}
        raise ValueError(f"bad body with {len(body)} keys")

    try:
        handler(secret)  # the source lines a traceback shows name the variables, not their values
    except ValueError as error:
        structlog.get_logger().error("proxy.request_failed", exc_info=error)
    text = stream.getvalue()
    assert "ValueError" in text and "bad body with 1 keys" in text and "handler" in text
    assert secret not in text and private not in text
