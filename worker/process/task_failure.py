"""Reporting a generate task that failed for good, so the proxy does not wait for its deadline (invariant 9).

A generate task that raises anything but a preemption hand-back or a transient error (those go back to the
queue or are retried) is reported with ``POST /v1/tasks/{task_id}/failure``: the proxy cancels the task at
once and counts one failed attempt for each of its prompts, which end as rejected at
``async.max_group_attempts``. The Celery task then ends normally (its message is acked): a retry loop would
only fail the same way again, and the proxy re-sends the prompts itself.
"""

from __future__ import annotations

from typing import Any

import structlog

from asyncgrpo.bucket.backends import ObjectNotFound
from asyncgrpo.bucket.manifest import IntegrityError
from asyncgrpo.protocol.client import ProxyClient, ProxyError
from asyncgrpo.protocol.schemas import TaskFailureReport

log = structlog.get_logger()


def failure_reason(error: BaseException) -> str:
    """The short label the proxy keeps as the rejection reason at the last attempt."""
    return f"task_error_{type(error).__name__}"


def report_task_failure(client: ProxyClient, task_id: str, worker_id: str, error: BaseException) -> dict[str, Any]:
    """Tell the proxy that ``task_id`` failed with ``error``; returns the task's JSON result."""
    report = TaskFailureReport(
        worker_id=worker_id,
        reason=failure_reason(error),
        detail=repr(error)[:2000],
        # A version that cannot be read is the bucket's fault (reported for repair), not the prompts'.
        prompt_at_fault=not isinstance(error, IntegrityError | ObjectNotFound),
    )
    try:
        cancelled = client.report_task_failure(task_id, report).cancelled
    except ProxyError as report_error:
        # The task's deadline at the proxy is the backstop.
        log.warning("generate.failure_report_failed", task_id=task_id, error=str(report_error))
        cancelled = False
    log.warning("generate.task_failure_reported", task_id=task_id, reason=report.reason, cancelled=cancelled)
    return {"task_id": task_id, "status": "failed", "reason": report.reason, "cancelled": cancelled}
