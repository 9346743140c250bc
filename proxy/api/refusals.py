"""Refusals as HTTP answers: which coordinator exception is which protocol error code, and the error body.

Every refusal is answered with the shared table's status (``proxy.protocol.errors``) and an ``ErrorBody``
``{"error", "detail", ...}``; each one is counted by code in ``asyncgrpo_http_errors``.
"""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from proxy.coordinator.errors import (
    BadRollout,
    BadStepFailure,
    LeaseLostError,
    NoVersionYet,
    PublishConflict,
    SnapshotFailed,
    StateMissing,
    StepNoLongerClaimed,
    StepNotFound,
    TaskCancelled,
)
from proxy.coordinator.metrics import ProxyMetrics
from proxy.protocol.errors import error_code
from proxy.protocol.schemas import ErrorBody
from proxy.protocol.staleness import StaleRolloutError
from proxy.storage.bucket import BucketError

log = structlog.get_logger()


# Which coordinator refusal is which protocol error code; the HTTP status comes from the shared table. A
# subclass takes its nearest listed ancestor's code (UnknownTask is cancelled, CasLost a conflict).
REFUSAL_CODES: dict[type[Exception], str] = {
    StaleRolloutError: "stale",
    NoVersionYet: "not_ready",
    PublishConflict: "conflict",
    LeaseLostError: "lease_lost",
    TaskCancelled: "cancelled",
    BadRollout: "bad_request",
    StepNotFound: "not_found",
    StepNoLongerClaimed: "not_claimed",
    BadStepFailure: "bad_request",
    SnapshotFailed: "unavailable",
    StateMissing: "unavailable",
    RedisError: "unavailable",
    BucketError: "unavailable",
}
SCHEMA_REFUSAL = "bad_request"
"""Sent with 422 for a body that does not match its schema."""
AUTH_REFUSAL = "unauthorized"
UNAVAILABLE = "unavailable"
"""Also what ``/healthz`` answers when Redis is unreachable."""
SENT_CODES = frozenset(REFUSAL_CODES.values()) | {SCHEMA_REFUSAL, AUTH_REFUSAL, UNAVAILABLE}
"""Every error code this server can send (checked against the table by a test)."""


def error_body(code: str, detail: str, *, status: int | None = None, **extra: Any) -> JSONResponse:
    entry = error_code(code)
    status = entry.status if status is None else status
    if status not in entry.statuses:
        raise ValueError(f"error code {code!r} is never sent with status {status}; see proxy.protocol.errors")
    body = ErrorBody(error=code, detail=detail, **extra)
    return JSONResponse(status_code=status, content=jsonable_encoder(body))


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def _refusal_code(exc: Exception) -> str:
    return next(REFUSAL_CODES[kind] for kind in type(exc).__mro__ if kind in REFUSAL_CODES)


def _refusal_fields(exc: Exception) -> dict[str, Any]:
    """What a client needs beyond the sentence to act on a refusal."""
    if isinstance(exc, StaleRolloutError):
        return {"version": exc.sample_version, "current_version": exc.current, "max_staleness": exc.max_staleness}
    if isinstance(exc, PublishConflict):
        return {"reason": _snake(type(exc).__name__), "current_version": exc.current_version}
    return {}


def install_error_handlers(app: FastAPI, metrics: ProxyMetrics) -> None:
    """Answer every coordinator refusal and schema failure with its code's body; count each by code."""

    def _error(code: str, detail: str, *, status: int | None = None, **extra: Any) -> JSONResponse:
        metrics.count_http_error(code)
        return error_body(code, detail, status=status, **extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(
            SCHEMA_REFUSAL,
            "the request body does not match the schema",
            status=422,
            errors=jsonable_encoder(exc.errors()),
        )

    async def _refused(_: Request, exc: Exception) -> JSONResponse:
        code = _refusal_code(exc)
        if code == UNAVAILABLE:
            log.warning("proxy.unavailable", error=str(exc), kind=type(exc).__name__)
            return _error(code, f"{type(exc).__name__}: {exc}; retry shortly")
        return _error(code, str(exc), **_refusal_fields(exc))

    for kind in REFUSAL_CODES:
        app.add_exception_handler(kind, _refused)
