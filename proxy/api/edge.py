"""The HTTP edge, what every request passes: the bearer-token check, the body limit and request timing as one
plain ASGI middleware (no per-request task or stream), and the refusals: which coordinator refusal is which
error code, the error body and its handlers.


Starlette's ``@app.middleware("http")`` wraps every request in a task, a memory stream and a streaming
response; at hundreds of requests a second that was a tenth of the proxy's CPU. This middleware does the same
work directly on the ASGI messages:

- refuse a request without the right token before routing (nothing changes; one fixed ``unauthorized`` route
  label, so a scanner cannot grow the label set). Every path needs the token except ``OPEN_PATHS`` (probes,
  Prometheus unless ``ASYNCGRPO_METRICS_NEED_TOKEN``, the API schema). The token is compared exactly: only
  the spaces after ``Bearer`` are skipped (the HTTP parser already dropped the value's outer whitespace);
- refuse a body over ``max_body_bytes`` (413) before anything parses it, whether it announced its length or not;
- time the request by its route template and method (unknown methods as ``other``) and log one
  ``proxy.request`` line (at debug level for the polled routes, unless refused).

Refusals as HTTP answers: which coordinator exception is which protocol error code, and the error body.

Every refusal is answered with the shared table's status (``asyncgrpo.protocol.errors``) and an ``ErrorBody``
``{"error", "detail", ...}``; each one is counted by code in ``asyncgrpo_http_errors``.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Union, get_args, get_origin

import structlog
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from redis.exceptions import RedisError
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asyncgrpo.bucket.backends import BucketError
from asyncgrpo.protocol.errors import ErrorBody, error_code
from asyncgrpo.protocol.schemas import StaleRolloutError, printable
from proxy.coordinator.metrics import ProxyMetrics
from proxy.coordinator.scripts import (
    BadRollout,
    BadStepFailure,
    LeaseLostError,
    NotTaskHolder,
    NoVersionYet,
    PublishConflict,
    SnapshotFailed,
    StateMissing,
    StepNoLongerClaimed,
    StepNotFound,
    TaskCancelled,
)

if TYPE_CHECKING:
    from fastapi._compat import ModelField

# Which coordinator refusal is which protocol error code; the HTTP status comes from the shared table. A
# subclass takes its nearest listed ancestor's code (UnknownTask is cancelled, CasLost a conflict).
REFUSAL_CODES: dict[type[Exception], str] = {
    StaleRolloutError: "stale",
    NoVersionYet: "not_ready",
    PublishConflict: "conflict",
    LeaseLostError: "lease_lost",
    TaskCancelled: "cancelled",
    BadRollout: "bad_request",
    NotTaskHolder: "not_holder",
    StepNotFound: "not_found",
    StepNoLongerClaimed: "not_claimed",
    BadStepFailure: "bad_request",
    SnapshotFailed: "unavailable",
    StateMissing: "unavailable",
    RedisError: "unavailable",
    BucketError: "unavailable",
}
SCHEMA_REFUSAL = "bad_request"
"""Sent with 422 for a request that does not match the schema, and with 400 for a body that is not JSON."""
AUTH_REFUSAL = "unauthorized"
UNAVAILABLE = "unavailable"
"""Also what ``/healthz`` answers when Redis is unreachable."""
INTERNAL = "internal"
"""A fault of the proxy itself: answered as such, never as the client's mistake."""
STARLETTE_REFUSALS = {
    400: (SCHEMA_REFUSAL, "the body could not be parsed: send JSON in UTF-8, nested at most a few hundred levels"),
    404: ("not_found", "no such path; the API is described at /openapi.json"),
    405: ("method_not_allowed", "this path does not take this method; see the Allow header"),
}
"""The refusals Starlette and FastAPI make themselves (unparsable body, unknown path, wrong method)."""
TOO_LARGE = "too_large"
SENT_CODES = (
    frozenset(REFUSAL_CODES.values())
    | {code for code, _ in STARLETTE_REFUSALS.values()}
    | {
        AUTH_REFUSAL,
        TOO_LARGE,
        UNAVAILABLE,
        INTERNAL,
    }
)
"""Every error code this server can send (checked against the table by a test)."""
MAX_DETAIL_CHARS = 1000
MAX_FIELD_ERRORS = 20
"""A 422 lists at most this many field errors: enough to fix a request, never a copy of a huge one."""
UNAVAILABLE_DETAIL = {
    RedisError: "Redis is unreachable or failed",
    BucketError: "the bucket is unreachable or failed",
    SnapshotFailed: "the run's snapshot could not be written to the bucket",
    StateMissing: "the run's state is being rebuilt",
}


def error_body(code: str, detail: str, *, status: int | None = None, **extra: Any) -> JSONResponse:
    entry = error_code(code)
    status = entry.status if status is None else status
    if status not in entry.statuses:
        raise ValueError(f"error code {code!r} is never sent with status {status}; see asyncgrpo.protocol.errors")
    body = ErrorBody(error=code, detail=printable(detail, MAX_DETAIL_CHARS), **extra)
    return JSONResponse(status_code=status, content=jsonable_encoder(body))


def answer(model: BaseModel) -> Response:
    """A route's answer, serialized once in pydantic's core. Returned as a model, FastAPI would validate it again
    against the route's ``response_model`` and encode it in two passes; the route still declares its model, which
    stays the schema of the answer (``/openapi.json``)."""
    return Response(model.model_dump_json(), media_type="application/json")


def field_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    """What a client needs to fix its request: where and what, bounded, and never the rejected value (which may
    be 50 MB, NaN, or text no JSON encoder can write)."""
    out = []
    for item in exc.errors()[:MAX_FIELD_ERRORS]:
        loc = [part if isinstance(part, int) else printable(str(part), 64) for part in item.get("loc", ())][:16]
        out.append({"loc": loc, "msg": printable(str(item.get("msg", "")), 300), "type": str(item.get("type", ""))})
    return out


class QueryCheckedRoute(APIRoute):
    """Every route's class: a query parameter the route does not take is a 422, as an unknown body field is (a
    misspelt ``wait_s`` must not silently mean the default). Checked in the route's handler, with the names it
    takes read once, rather than as a dependency of every route: FastAPI resolves a dependency per request."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        known = frozenset(param.alias for param in self.dependant.query_params)

        async def checked(request: Request) -> Response:
            if request.scope.get("query_string"):  # the usual request has none: nothing to parse
                unknown = [name for name in request.query_params if name not in known]
                if unknown:
                    raise RequestValidationError(
                        [
                            {"loc": ("query", name), "msg": "Extra inputs are not permitted", "type": "extra_forbidden"}
                            for name in unknown
                        ]
                    )
            return await handler(request)

        return checked


class FleetRoute(QueryCheckedRoute):
    """The class of the fleet's routes (heartbeats, leases, renewals, releases, submits, the long poll: hundreds of
    requests a second). ``values`` validates a request in one pass: its path and query parameters by the route's
    own types, its body (if it takes one) by its model with ``model_validate_json``; ``FleetDispatch`` then awaits
    the endpoint with them, past the router and FastAPI's per-request dependency machinery. A request ``values``
    does not take (an unknown or missing parameter, a value a type refuses, another content type, a body the model
    refuses) goes to FastAPI's own handler, which answers it as it answers every route (its 422s). So the route
    stays FastAPI's: its signature, types and models are the one definition of the request and of
    ``/openapi.json``, and its endpoint, which returns a ``Response`` (``answer``), the one implementation."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        general = super().get_route_handler()
        dependant = self.dependant
        if (
            dependant.header_params
            or dependant.cookie_params
            or dependant.dependencies
            or len(dependant.body_params) > 1
        ):
            raise TypeError(f"{self.path}: a FleetRoute takes path and query parameters and one JSON body, no more")
        self._params = [_Param.of(param, in_path=True) for param in dependant.path_params]
        self._params += [_Param.of(param, in_path=False) for param in dependant.query_params]
        self._known_query = frozenset(param.alias for param in self._params if not param.in_path)
        self._body = _Body.of(dependant.body_params[0], self.path) if dependant.body_params else None

        async def handler(request: Request) -> Response:  # reached through the router (FleetDispatch passed it on)
            values = await self.values(request.scope, await request.body() if self._body else b"")
            return await general(request) if values is None else await self.endpoint(**values)

        return handler

    async def values(self, scope: Scope, body: bytes) -> dict[str, Any] | None:
        """The endpoint's arguments from the request of ``scope`` (matched: its path parameters are in) with
        ``body``, or None: FastAPI's own handler is to answer it."""
        query: Mapping[str, str] = QueryParams(scope["query_string"]) if scope.get("query_string") else {}
        if query and not set(query) <= self._known_query:
            return None  # FastAPI's 422 names the unknown parameters
        values: dict[str, Any] = {}
        path_params = scope["path_params"]
        for param in self._params:
            source = path_params if param.in_path else query
            if param.alias not in source:
                if param.required:
                    return None
                values[param.name] = param.default
                continue
            try:
                values[param.name] = param.adapter.validate_python(source[param.alias])
            except ValidationError:
                return None
        model = self._body
        if model is not None:
            if not body and model.optional:
                values[model.name] = None
            elif not _json_body(scope):
                return None
            else:
                try:
                    values[model.name] = model.model.model_validate_json(body)
                except ValidationError:
                    return None
        return values


class FleetDispatch:
    """ASGI, inside ``AuthAndTiming``: a request for a ``FleetRoute`` of ``app`` is answered by that route's
    endpoint with the arguments its ``values`` validated, a refusal it raises by the app's own exception handler
    (a fault goes on up, to the handler of faults); every other request, and any the route's ``values`` does not
    take, goes on to the app unchanged, nothing having run. What it saves on each of the fleet's requests is the
    router's scan, Starlette's exception and exit-stack layers and FastAPI's request wrapper."""

    def __init__(self, asgi: ASGIApp, *, app: FastAPI) -> None:
        self.asgi = asgi
        self.fastapi = app
        self._routes: list[FleetRoute] | None = None

    def _fleet_routes(self) -> list[FleetRoute]:
        if self._routes is None:  # the routes are all in once the app serves
            self._routes = [route for route in self.fastapi.router.routes if isinstance(route, FleetRoute)]
        return self._routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route, child = _matching(self._fleet_routes(), scope) if scope["type"] == "http" else (None, {})
        if route is None:
            await self.asgi(scope, receive, send)
            return
        body = scope.get(BODY_KEY)
        if body is None:  # not read outside (a GET; a client gone; no AuthAndTiming around): read it here
            messages = await _read_messages(receive) if scope["method"] not in BODILESS_METHODS else []
            receive = replay(messages, receive)
            if messages and messages[-1]["type"] != "http.request":  # the client went away: the app's to see
                await self.asgi(scope, receive, send)
                return
            body = b"".join(message.get("body", b"") for message in messages)
        scope.update(child)  # the route and its path parameters, as the router sets them (the timing's label)
        values = await route.values(scope, body)
        if values is None:
            await self.asgi(scope, receive, send)
            return
        try:
            response = await route.endpoint(**values)
        except Exception as error:
            handler = _refusal_handler(self.fastapi, error)
            if handler is None:
                raise
            response = await handler(Request(scope, receive), error)
        await response(scope, receive, send)


def _matching(routes: list[FleetRoute], scope: Scope) -> tuple[FleetRoute | None, dict[str, Any]]:
    for route in routes:
        match, child = route.matches(scope)
        if match is Match.FULL:
            return route, child
    return None, {}


def _refusal_handler(app: FastAPI, error: Exception) -> Callable[..., Any] | None:
    """The app's handler of ``error``'s nearest class, as Starlette's exception layer looks it up; not the handler
    of every ``Exception`` (a fault), which the outermost layer runs."""
    for kind in type(error).__mro__:
        if kind is Exception:
            return None
        if kind in app.exception_handlers:
            return app.exception_handlers[kind]
    return None


async def _read_messages(receive: Receive) -> list[Message]:
    """Every body message (``AuthAndTiming`` enforced the body limit outside)."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages


@contextmanager
def routes_of(app: FastAPI, route_class: type[APIRoute]) -> Iterator[None]:
    """The routes added to ``app`` inside are of ``route_class`` (an included router would add a matching layer
    to every request)."""
    previous, app.router.route_class = app.router.route_class, route_class
    try:
        yield
    finally:
        app.router.route_class = previous


@dataclass(frozen=True)
class _Param:
    """A path or query parameter of a ``FleetRoute``, validated as FastAPI validates it (its type and field)."""

    name: str
    alias: str
    in_path: bool
    required: bool
    default: Any
    adapter: TypeAdapter[Any]

    @classmethod
    def of(cls, param: ModelField, *, in_path: bool) -> _Param:
        info = param.field_info
        adapter: TypeAdapter[Any] = TypeAdapter(Annotated[info.annotation, info])
        return cls(param.name, param.alias, in_path, info.is_required(), info.default, adapter)


@dataclass(frozen=True)
class _Body:
    """The JSON body of a ``FleetRoute``: one pydantic model, or the model or nothing."""

    name: str
    model: type[BaseModel]
    optional: bool

    @classmethod
    def of(cls, param: ModelField, path: str) -> _Body:
        annotation = param.field_info.annotation
        members = [a for a in get_args(annotation) if a is not type(None)] if get_origin(annotation) in _UNIONS else []
        model = members[0] if len(members) == 1 else annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or getattr(param.field_info, "embed", False):
            raise TypeError(f"{path}: a FleetRoute's body is one pydantic model (or it or nothing), not embedded")
        return cls(param.name, model, optional=model is not annotation and not param.field_info.is_required())


_UNIONS = (Union, UnionType)


def _json_body(scope: Scope) -> bool:
    """Whether the request says its body is JSON (FastAPI also reads a body without a content type as JSON)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";")[0].strip().lower() == b"application/json"
    return False


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def _refusal_code(exc: Exception) -> str:
    return next(REFUSAL_CODES[kind] for kind in type(exc).__mro__ if kind in REFUSAL_CODES)


def _unavailable_detail(exc: Exception) -> str:
    what = next((text for kind, text in UNAVAILABLE_DETAIL.items() if isinstance(exc, kind)), "a store failed")
    return f"{what}; retry shortly (the proxy's log has the error)"


def _refusal_fields(exc: Exception) -> dict[str, Any]:
    """What a client needs beyond the sentence to act on a refusal."""
    if isinstance(exc, StaleRolloutError):
        return {"version": exc.sample_version, "current_version": exc.current, "max_staleness": exc.max_staleness}
    if isinstance(exc, PublishConflict):
        return {"reason": _snake(type(exc).__name__), "current_version": exc.current_version}
    return {}


def counted_error(
    metrics: ProxyMetrics, code: str, detail: str, *, status: int | None = None, **extra: Any
) -> JSONResponse:
    metrics.count_http_error(code)
    return error_body(code, detail, status=status, **extra)


def refusal_answer(exc: Exception, metrics: ProxyMetrics) -> JSONResponse:
    """The answer to a refusal (``is_refusal``), counted."""
    code = _refusal_code(exc)
    if code == UNAVAILABLE:
        log.warning("proxy.unavailable", error=str(exc), kind=type(exc).__name__)
        return counted_error(metrics, code, _unavailable_detail(exc))
    return counted_error(metrics, code, str(exc), **_refusal_fields(exc))


def fault_answer(exc: Exception, metrics: ProxyMetrics) -> JSONResponse:
    """The answer to a fault of the proxy itself (any other exception), logged with its traceback."""
    log.error("proxy.request_failed", error=repr(exc)[:MAX_DETAIL_CHARS], kind=type(exc).__name__, exc_info=exc)
    return counted_error(
        metrics, INTERNAL, "the proxy failed to answer this request; its log has the error", status=500
    )


def install_error_handlers(app: FastAPI, metrics: ProxyMetrics) -> None:
    """Answer every refusal, schema failure, parse error, unknown path and fault with an ``ErrorBody``; count
    each by code."""

    def _error(code: str, detail: str, *, status: int | None = None, **extra: Any) -> JSONResponse:
        return counted_error(metrics, code, detail, status=status, **extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = field_errors(exc)
        where = ", ".join(".".join(str(part) for part in error["loc"]) for error in errors[:3])
        return _error(SCHEMA_REFUSAL, f"the request does not match the schema ({where})", status=422, errors=errors)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code not in STARLETTE_REFUSALS:  # not one Starlette sends on its own: a fault of ours
            log.error("proxy.unexpected_http_exception", status=exc.status_code, detail=str(exc.detail))
            return _error(INTERNAL, "the proxy failed to answer this request", status=500)
        code, detail = STARLETTE_REFUSALS[exc.status_code]
        response = _error(code, detail, status=exc.status_code)
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _fault(_: Request, exc: Exception) -> JSONResponse:
        return fault_answer(exc, metrics)

    async def _refused(_: Request, exc: Exception) -> JSONResponse:
        return refusal_answer(exc, metrics)

    for kind in REFUSAL_CODES:
        app.add_exception_handler(kind, _refused)


log = structlog.get_logger()

OPEN_PATHS = frozenset({"/healthz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
"""Answered without the token: they carry no ids (``/metrics`` can be closed too)."""
QUIET_ROUTES = frozenset(
    {
        "/metrics",
        "/healthz",
        "/v1/status",
        "/v1/workers",
        "/v1/workers/heartbeat",
        "/v1/versions/latest",
        "/v1/leases/{lease_id}/renew",
    }
)
"""Polled by dashboards and people, or sent by every worker every few seconds: their request lines are logged
at debug level only, unless refused (at 1,000 workers the heartbeats alone were 200 lines a second, and logging
was 8 % of the proxy's CPU). ``asyncgrpo_http_request_seconds`` counts them all."""
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Metric label values for the method; anything else a client makes up is counted as ``other``."""
BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods whose body is not read ahead (nor limited: no route here takes one)."""
BODY_KEY = "asyncgrpo.body"
"""Where ``AuthAndTiming`` leaves the body it read (the whole of it, in bytes) in the scope, so that what answers
the request inside (``FleetDispatch``) need not buffer it again."""
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
        if scope["method"] not in BODILESS_METHODS:
            body = await self._read_body(scope, receive)
            if body is None:
                await self._refused("too_large", TOO_LARGE_ROUTE, method, started, scope, receive, send)
                return
            receive = replay(body, receive)
            if body[-1]["type"] == "http.request":  # all of it (else the client went away: nothing to hand in)
                scope[BODY_KEY] = b"".join(message.get("body", b"") for message in body)
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
        log_line = log.debug if route in QUIET_ROUTES and status < 400 else log.info
        log_line("proxy.request", method=method, route=route, status=status, seconds=seconds)

    async def _refused(
        self, code: str, route: str, method: str, started: float, scope: Scope, receive: Receive, send: Send
    ) -> None:
        await self.refuse(code)(scope, receive, send)
        self.metrics.http_seconds.labels(route, method).observe(time.perf_counter() - started)


def replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that hands out the body already read, then waits on the real one (for a disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
