"""Bearer-token check and request timing as one plain ASGI middleware (no per-request task or stream).

Starlette's ``@app.middleware("http")`` wraps every request in a task, a memory stream and a streaming
response; at hundreds of requests a second that was a tenth of the proxy's CPU. This middleware does the same
work directly on the ASGI messages: refuse a state-changing request without the right token before routing
(nothing changes, one fixed ``unauthorized`` route label, so a scanner cannot grow the label set), then time
the request by its route template and log one ``proxy.request`` line (at debug level for polled routes).
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

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
QUIET_ROUTES = frozenset({"/metrics", "/healthz", "/v1/status", "/v1/workers"})
"""Polled by dashboards and people: their request lines are logged at debug level only."""
UNAUTHORIZED_ROUTE = "unauthorized"


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the first ``Authorization: Bearer <token>`` header; None without one."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, given = value.partition(b" ")
            return given.strip() if scheme.lower() == b"bearer" else None
    return None


class AuthAndTiming:
    """Refuse state-changing requests without ``token`` (``refuse()`` makes the answer); time and log all."""

    def __init__(
        self, app: ASGIApp, *, token: bytes | None, metrics: ProxyMetrics, refuse: Callable[[], Response]
    ) -> None:
        self.app = app
        self.token = token
        self.metrics = metrics
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method = scope["method"]
        if self.token is not None and method in STATE_CHANGING:
            given = bearer_token(scope)
            if given is None or not hmac.compare_digest(given, self.token):
                await self.refuse()(scope, receive, send)
                self.metrics.http_seconds.labels(UNAUTHORIZED_ROUTE, method).observe(time.perf_counter() - started)
                return
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
