"""Fixtures live in role-named plugin modules; this file loads them, and sets how this process logs."""

import contextlib
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

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


# `make test-fast` sets this: its layer (unit and contract tests) starts no process of its own, so a test that
# does fails there, naming the marker it needs. The services the suite shares (Redis, SeaweedFS) are allowed:
# they are what the layer tests against, as a user's Redis and bucket.
NO_PROCESSES_ENV = "ASYNCGRPO_TESTS_NO_PROCESSES"
SERVICES = frozenset({"redis-server", "weed"})


@pytest.fixture(scope="session", autouse=True)
def library_caches_built() -> None:
    """matplotlib builds its font cache on its first import on a machine, running ``fc-list``: a library's
    one-time set-up, not a process a test starts. The fast layer builds it here, before its guard is on."""
    if os.environ.get(NO_PROCESSES_ENV) == "1":
        with contextlib.suppress(ImportError):
            import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def no_processes_in_the_fast_layer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get(NO_PROCESSES_ENV) != "1" or request.node.get_closest_marker("processes"):
        return
    refusal = (
        f"{request.node.nodeid} starts a process: mark it @pytest.mark.processes "
        f"(the fast layer, {NO_PROCESSES_ENV}=1, starts none but {sorted(SERVICES)})"
    )
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def services_only(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        program = args if isinstance(args, str | bytes | os.PathLike) else args[0]
        if os.path.basename(os.fsdecode(program)) not in SERVICES:
            raise RuntimeError(refusal)
        execute_child(self, args, *rest, **kwargs)

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(refusal)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", services_only)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
