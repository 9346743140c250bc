"""Bearer-token check, body limit and request timing as one plain ASGI middleware (no per-request task or stream).

Starlette's ``@app.middleware("http")`` wraps every request in a task, a memory stream and a streaming
response; at hundreds of requests a second that was a tenth of the proxy's CPU. This middleware does the same
work directly on the ASGI messages:

- refuse a request without the right token before routing (nothing changes; one fixed ``unauthorized`` route
  label, so a scanner cannot grow the label set). Every path needs the token except ``OPEN_PATHS`` (probes,
  Prometheus unless ``ASYNCGRPO_METRICS_NEED_TOKEN``, the API schema). The token is compared exactly: only
  the spaces after ``Bearer`` are skipped (the HTTP parser already dropped the value's outer whitespace);
- refuse a body over ``max_body_bytes`` (413) before anything parses it, whether it announced its length or not;
- time the request by its route template and method (unknown methods as ``other``) and log one
  ``proxy.request`` line (at debug level for polled routes).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable

import structlog
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.coordinator.metrics import ProxyMetrics

log = structlog.get_logger()

OPEN_PATHS = frozenset({"/healthz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
"""Answered without the token: they carry no ids (``/metrics`` can be closed too)."""
QUIET_ROUTES = frozenset({"/metrics", "/healthz", "/v1/status", "/v1/workers"})
"""Polled by dashboards and people: their request lines are logged at debug level only."""
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Metric label values for the method; anything else a client makes up is counted as ``other``."""
UNAUTHORIZED_ROUTE = "unauthorized"
TOO_LARGE_ROUTE = "too_large"


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the first ``Authorization: Bearer <token>`` header, exactly as sent; None without one."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, given = value.partition(b" ")
            # RFC 7235: one or more spaces after the scheme; nothing else is stripped (a token followed by a
            # no-break space or a vertical tab is another token).
            return given.lstrip(b" ") if scheme.lower() == b"bearer" else None
    return None


def announced_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class AuthAndTiming:
    """Refuse requests without ``token`` and bodies over ``max_body_bytes`` (``refuse(code)`` makes the
    answer); time and log all."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: bytes | None,
        metrics: ProxyMetrics,
        refuse: Callable[[str], Response],
        max_body_bytes: int,
        open_paths: frozenset[str] = OPEN_PATHS,
    ) -> None:
        self.app = app
        self.token = token
        self.metrics = metrics
        self.refuse = refuse
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths

    def _authorized(self, scope: Scope) -> bool:
        if self.token is None or scope["path"] in self.open_paths:
            return True
        given = bearer_token(scope)
        return given is not None and hmac.compare_digest(given, self.token)

    async def _read_body(self, scope: Scope, receive: Receive) -> list[Message] | None:
        """The request's body messages, or None once they exceed the limit (read no further)."""
        announced = announced_length(scope)
        if announced is not None and announced > self.max_body_bytes:
            return None
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # the client went away: let the app see it
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return messages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"
        if not self._authorized(scope):
            await self._refused("unauthorized", UNAUTHORIZED_ROUTE, method, started, scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            body = await self._read_body(scope, receive)
            if body is None:
                await self._refused("too_large", TOO_LARGE_ROUTE, method, started, scope, receive, send)
                return
            receive = _replay(body, receive)
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, send_and_note)
        # The router put the matched route into the scope it was handed (this very dict).
        route = getattr(scope.get("route"), "path", "unmatched")
        seconds = time.perf_counter() - started
        self.metrics.http_seconds.labels(route, method).observe(seconds)
        log_line = log.debug if route in QUIET_ROUTES else log.info
        log_line("proxy.request", method=method, route=route, status=status, seconds=seconds)

    async def _refused(
        self, code: str, route: str, method: str, started: float, scope: Scope, receive: Receive, send: Send
    ) -> None:
        await self.refuse(code)(scope, receive, send)
        self.metrics.http_seconds.labels(route, method).observe(time.perf_counter() - started)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that hands out the body already read, then waits on the real one (for a disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
