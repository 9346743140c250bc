"""Fixtures live in role-named plugin modules; this file loads them, and sets how this process logs."""

import sys
from collections.abc import Iterator

import pytest
import structlog

from worker.process.settings import process_settings

pytest_plugins = [
    "tests.support.fixtures_redis",
    "tests.support.fixtures_s3",
    "tests.support.fixtures_model",
    "tests.support.fixtures_coordinator",
    "tests.support.e2e_harness",
]

# Proxies served inside the test process log from their server threads. structlog's default logger writes to
# whatever sys.stdout is when it logs, which pytest and schemathesis swap for a capture stream per test and
# per subtest and then close: a server thread writing into a stream the main thread is closing crashed the
# interpreter. The process's own stderr stays open (pytest still captures it at the file descriptor), and
# tracebacks leave out the frames' locals, as in the real processes (asyncgrpo.protocol.log_setup).
structlog.configure(
    processors=[
        *structlog.get_config()["processors"][:-1],
        structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback),
    ],
    logger_factory=structlog.PrintLoggerFactory(sys.__stderr__),
)


@pytest.fixture(autouse=True)
def fresh_worker_settings() -> Iterator[None]:
    """A worker process parses its settings once (``process_settings``); each test is a process of its own,
    with the environment it set."""
    process_settings.cache_clear()
    yield
    process_settings.cache_clear()
