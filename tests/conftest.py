"""Fixtures live in role-named plugin modules; this file loads them, and sets how this process logs."""

import structlog

pytest_plugins = [
    "tests.fixtures_redis",
    "tests.fixtures_s3",
    "tests.fixtures_model",
    "tests.fixtures_coordinator",
    "tests.e2e_harness",
]

# Proxies served inside the test process log through structlog's default console renderer; like the real
# processes (proxy.protocol.log_setup), it prints tracebacks without walking every frame's locals.
structlog.configure(
    processors=[
        *structlog.get_config()["processors"][:-1],
        structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback),
    ]
)
