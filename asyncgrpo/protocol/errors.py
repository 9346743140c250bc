"""The proxy's error codes, shared by both ends of the HTTP API.

Every refusal is a JSON body ``{"error": <code>, "detail": <sentence>, ...}``. This table is the one place
that says, for each code, the HTTP status the proxy answers with and the exception the client raises, so
the server (``proxy.api.app``, which decides which coordinator refusal is which code) and the client
(``asyncgrpo.protocol.client``) cannot drift apart. A test checks that every code the server sends is here.

All client exceptions derive from ``ProxyError``; ``ProxyUnavailable`` is also raised when the proxy cannot
be reached at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict


class ProxyError(Exception):
    """Base of every failure talking to the proxy; ``status``/``error``/``body`` describe the answer."""

    def __init__(self, message: str, *, status: int | None = None, error: str | None = None, body: Any = None):
        super().__init__(message)
        self.status = status
        self.error = error
        self.body = body if body is not None else {}


class StaleRollout(ProxyError):
    """409 stale: the rollout's version is too far behind; its groups were requeued."""


class Conflict(ProxyError):
    """409 conflict: a publish was refused (CAS lost, manifest missing or mismatching); drop the work."""


class NotReady(ProxyError):
    """409 not_ready: no version published yet."""


class LeaseLost(ProxyError):
    """410 lease_lost: the lease expired or is unknown."""


class Cancelled(ProxyError):
    """410 cancelled: the generate task was cancelled (timed out, superseded, unknown); drop the work."""


class NotHolder(ProxyError):
    """409 not_holder: the submission is not bound to its lease (another worker holds the task, the version or
    lease is not the one leased for it, another rollout was admitted); nothing changed. Drop the work quietly:
    the task is someone else's, or done."""


class StepGone(ProxyError):
    """409 not_claimed: the step is no longer claimed with this batch (published, or claimed again with
    another batch); drop this copy of the task."""


class Unauthorized(ProxyError):
    """401 unauthorized: missing or wrong ASYNCGRPO_TOKEN."""


class BadRequest(ProxyError):
    """400/422 bad_request: the request does not match the protocol; the message says which field."""


class NotFound(ProxyError):
    """404 not_found: e.g. a step that was never claimed, or a path this proxy does not serve."""


class MethodNotAllowed(BadRequest):
    """405 method_not_allowed: the path takes other methods (a client built for another version)."""


class TooLarge(BadRequest):
    """413 too_large: the body is over the proxy's ASYNCGRPO_MAX_BODY_BYTES."""


class ProxyUnavailable(ProxyError):
    """503 unavailable, or no answer at all: the proxy could not be reached, or kept answering 502/503/504,
    after every retry."""


class ProxyFault(ProxyUnavailable):
    """500 internal: the proxy failed on this request (a bug; its log has it). Treated as unavailable."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # a newer proxy may add fields


class ErrorBody(_Body):
    """Body of every 4xx/5xx answer: ``error`` is a stable code, ``detail`` a sentence for humans. Some codes
    add fields (a stale refusal its versions, a 422 its ``errors``); the body never echoes the request."""

    error: str
    detail: str


class FieldError(_Body):
    """One reason a request was refused (422): where (``loc``), what is wrong (``msg``), pydantic's ``type``."""

    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(ErrorBody):
    """422 ``bad_request``: the body, path or query does not match the schema; at most 20 ``errors``."""

    errors: list[FieldError]


@dataclass(frozen=True)
class ErrorCode:
    """One row of the table: the code, the HTTP status(es) it is sent with, the client's exception."""

    code: str
    statuses: tuple[int, ...]
    """The first is the status of a refusal; ``bad_request`` is also sent as 422 for a request that fails the
    schema (FastAPI's convention), which the client treats the same."""
    exception: type[ProxyError]
    meaning: str

    @property
    def status(self) -> int:
        return self.statuses[0]


ERROR_CODES: dict[str, ErrorCode] = {
    entry.code: entry
    for entry in (
        ErrorCode("stale", (409,), StaleRollout, "the rollout is too old; its groups were counted and requeued"),
        ErrorCode("not_ready", (409,), NotReady, "no version published yet (leases)"),
        ErrorCode("conflict", (409,), Conflict, "a publish refused (CAS lost, manifest missing or mismatching)"),
        ErrorCode("not_claimed", (409,), StepGone, "the step is no longer claimed with this batch; drop the task"),
        ErrorCode(
            "not_holder", (409,), NotHolder, "a rollout or eval result not bound to the sender's lease of the task"
        ),
        ErrorCode("lease_lost", (410,), LeaseLost, "the lease expired or is unknown"),
        ErrorCode("cancelled", (410,), Cancelled, "the generate task was cancelled or is unknown; groups requeued"),
        ErrorCode("bad_request", (400, 422), BadRequest, "a submission that does not match its task, or the schema"),
        ErrorCode("not_found", (404,), NotFound, "no such step, version or path"),
        ErrorCode("method_not_allowed", (405,), MethodNotAllowed, "the path exists, the method does not (see Allow)"),
        ErrorCode("too_large", (413,), TooLarge, "the request body is over the proxy's limit"),
        ErrorCode("unavailable", (503,), ProxyUnavailable, "Redis or the bucket is unreachable right now; retry"),
        ErrorCode("unauthorized", (401,), Unauthorized, "missing or wrong bearer token"),
        ErrorCode("internal", (500,), ProxyFault, "a fault of the proxy itself (its log has it); retried"),
    )
}


def error_code(code: str) -> ErrorCode:
    """The table's row for ``code``; a code missing from the table is a bug on the side that uses it."""
    try:
        return ERROR_CODES[code]
    except KeyError:
        raise KeyError(f"error code {code!r} is not in asyncgrpo.protocol.errors.ERROR_CODES; add it there") from None


def _exceptions_by_status() -> dict[int, type[ProxyError]]:
    # For an answer without a known code (a reverse proxy's page, FastAPI's own 404): a status that only
    # one code uses says which exception it is; a shared one (409, 410) stays a plain ProxyError.
    owners: dict[int, set[type[ProxyError]]] = {}
    for entry in ERROR_CODES.values():
        for status in entry.statuses:
            owners.setdefault(status, set()).add(entry.exception)
    return {status: next(iter(kinds)) for status, kinds in owners.items() if len(kinds) == 1}


_BY_STATUS = _exceptions_by_status()


def exception_for(status: int, code: str | None) -> type[ProxyError]:
    """The exception the client raises for an error answer: by its code, else by its status."""
    if code in ERROR_CODES:
        return ERROR_CODES[code].exception
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if status >= 500:
        return ProxyUnavailable
    return ProxyError
