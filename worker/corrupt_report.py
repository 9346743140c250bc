"""Reporting a corrupted object of a published version to the proxy, from either role.

A generate worker finds one fetching a leased adapter, an optimize worker loading its base version or checking
an earlier upload: either way the proxy repairs it from the holder's memory or halts the run.
"""

from __future__ import annotations

import structlog

from asyncgrpo.bucket.layout import IntegrityError
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.errors import ProxyError

log = structlog.get_logger()


def report_corrupt(client: ProxyClient, version: int, worker_id: str, error: IntegrityError, *, role: str) -> None:
    """Tell the proxy that an object of published ``version`` failed its check; ``role`` ("generate",
    "optimize") names the log events. A failed report is only logged: the task fails either way."""
    try:
        answer = client.report_corrupt(version, worker_id, error.key)
        log.warning(f"{role}.corrupt_reported", version=version, key=error.key, action=answer.action)
    except ProxyError as report_error:
        log.warning(f"{role}.corrupt_report_failed", version=version, key=error.key, error=str(report_error))
