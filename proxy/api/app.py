"""The proxy's HTTP API (FastAPI) and ``serve()``, which ``asyncgrpo proxy`` calls.

Every POST/DELETE needs ``Authorization: Bearer <ASYNCGRPO_TOKEN>`` (checked with ``hmac.compare_digest``
before the body is even parsed): 401 otherwise, and nothing changes. A malformed body is a 422 and changes
nothing. Refusals are JSON ``{"error": <code>, "detail": <sentence>, ...}``; the codes, their HTTP status and
the client exception each one raises are the table in ``proxy.protocol.errors``. This module decides which
coordinator refusal is which code (``REFUSAL_CODES``); a stale refusal also carries ``version``,
``current_version`` and ``max_staleness``, a publish conflict its ``reason`` and ``current_version``.

Each refusal is counted in ``asyncgrpo_http_errors_total{error=<code>}``.

The housekeeping loop (``Coordinator.tick``) runs as an asyncio task of the app's lifespan, every
``tick_s`` seconds and right after each submit and publish.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Annotated, Any

import anyio.to_thread
import structlog
from fastapi import Body, FastAPI, Path, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from proxy.api.middleware import AuthAndTiming
from proxy.api.settings import ProxySettings
from proxy.api.version_watch import install_version_watch, releasing_server
from proxy.coordinator.errors import (
    BadRollout,
    LeaseLostError,
    NoVersionYet,
    PublishConflict,
    SnapshotFailed,
    StateMissing,
    StepNotFound,
    TaskCancelled,
)
from proxy.coordinator.metrics import ProxyMetrics
from proxy.coordinator.service import Coordinator
from proxy.protocol.errors import error_code
from proxy.protocol.schemas import (
    ID_PATTERN,
    ErrorBody,
    HeartbeatRequest,
    HeartbeatResult,
    LeaseGrant,
    LeaseRequest,
    PublishRequest,
    PublishResult,
    ReleaseResult,
    RenewRequest,
    RolloutSubmission,
    RunInfo,
    StatusResponse,
    StepBatch,
    SubmitResult,
    WorkersResponse,
)
from proxy.protocol.staleness import StaleRolloutError
from proxy.storage.bucket import BucketError

log = structlog.get_logger()

LeaseId = Annotated[str, Path(pattern=ID_PATTERN)]
HANDLER_THREADS = 512
"""Threads for the sync handlers (anyio's default is 40); most of them wait on Redis or on a snapshot put."""


class ProxyStartupError(Exception):
    """The proxy cannot start as configured; the message says what to change."""


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


def _error_body(code: str, detail: str, *, status: int | None = None, **extra: Any) -> JSONResponse:
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
        return _error_body(code, detail, status=status, **extra)

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


def create_app(coordinator: Coordinator, token: str | None, *, tick_s: float = 0.25, run_loop: bool = True) -> FastAPI:
    """The API of one run. ``token=None`` disables auth (only ``serve`` on loopback may do that).
    ``run_loop=False`` leaves ``tick()`` to the caller (tests)."""
    wake = asyncio.Event()
    loop_holder: dict[str, asyncio.AbstractEventLoop] = {}

    async def housekeeping() -> None:
        while True:
            try:
                await asyncio.to_thread(coordinator.tick)
            except Exception:  # the loop must outlive any one failed round; it is logged, not passed
                log.exception("proxy.tick_failed")
            with suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=tick_s)
            wake.clear()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop_holder["loop"] = asyncio.get_running_loop()
        # Sync handlers run in anyio's threadpool; a submit holds its thread while group commit makes it durable,
        # so with hundreds of workers the default 40 threads would queue leases behind waiting submits.
        anyio.to_thread.current_default_thread_limiter().total_tokens = HANDLER_THREADS
        task = asyncio.create_task(housekeeping()) if run_loop else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task

    def poke() -> None:
        """Run a housekeeping round soon (called from request threads)."""
        loop = loop_holder.get("loop")
        if loop is not None and run_loop:
            loop.call_soon_threadsafe(wake.set)

    app = FastAPI(
        title="asyncgrpo proxy",
        version="1",
        description=__doc__,
        lifespan=lifespan,
    )
    app.state.coordinator = coordinator
    metrics = coordinator.metrics
    metrics.watch_state(coordinator.gauges, coordinator.run_limits())  # counts only: cheap per scrape
    expected = token.encode() if token else None

    def unauthorized() -> Response:
        metrics.count_http_error(AUTH_REFUSAL)
        response = _error_body(AUTH_REFUSAL, "missing or wrong bearer token (ASYNCGRPO_TOKEN)")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    app.add_middleware(AuthAndTiming, token=expected, metrics=metrics, refuse=unauthorized)
    install_error_handlers(app, metrics)
    # GET /v1/versions/latest, the generate workers' long poll for new versions (proxy.api.version_watch).
    version_watch = install_version_watch(app, coordinator)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        try:
            current = coordinator.current_version()
        except RedisError as error:
            metrics.count_http_error(UNAVAILABLE)
            return _error_body(UNAVAILABLE, f"Redis unreachable: {error}")
        return JSONResponse({"status": "ok", "run": coordinator.run, "current_version": current})

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status", response_model=StatusResponse)
    def status() -> StatusResponse:
        return coordinator.status()

    @app.get("/v1/workers", response_model=WorkersResponse)
    def workers() -> WorkersResponse:
        return WorkersResponse(workers=coordinator.workers())

    @app.get("/v1/run", response_model=RunInfo)
    def run_info() -> RunInfo:
        return coordinator.run_info()

    @app.post("/v1/leases", response_model=LeaseGrant)
    def grant_lease(request: LeaseRequest) -> LeaseGrant:
        return coordinator.lease(request.worker_id, request.task_id)

    @app.post("/v1/leases/{lease_id}/renew", response_model=LeaseGrant)
    def renew_lease(lease_id: LeaseId, _: Annotated[RenewRequest | None, Body()] = None) -> LeaseGrant:
        return coordinator.renew(lease_id)

    @app.delete("/v1/leases/{lease_id}", response_model=ReleaseResult)
    def release_lease(lease_id: LeaseId) -> ReleaseResult:
        return ReleaseResult(released=coordinator.release(lease_id))

    @app.post("/v1/rollouts", response_model=SubmitResult)
    def submit_rollout(submission: RolloutSubmission) -> SubmitResult:
        try:
            return coordinator.submit(submission)
        finally:
            poke()

    @app.get("/v1/steps/{step}", response_model=StepBatch)
    def get_step(step: Annotated[int, Path(ge=0)]) -> StepBatch:
        return coordinator.get_step(step)

    @app.post("/v1/versions", response_model=PublishResult)
    def publish_version(request: PublishRequest) -> PublishResult:
        try:
            return coordinator.publish(request)
        finally:
            version_watch.notify()
            poke()

    @app.post("/v1/workers/heartbeat", response_model=HeartbeatResult)
    def heartbeat(report: HeartbeatRequest) -> HeartbeatResult:
        coordinator.heartbeat(report)
        return HeartbeatResult()

    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_can_serve(host: str, token: str | None, insecure_loopback: bool) -> None:
    """Refuse to serve without a token, except on a loopback address with --insecure-loopback."""
    if token:
        return
    if not insecure_loopback:
        raise ProxyStartupError(
            "ASYNCGRPO_TOKEN is not set: set it to a long random secret (e.g. `openssl rand -hex 32`) shared "
            "with the workers, or pass --insecure-loopback with --host 127.0.0.1 for a local test"
        )
    if not is_loopback(host):
        raise ProxyStartupError(
            f"--insecure-loopback is only allowed with a loopback --host (127.0.0.1, ::1, localhost), not "
            f"{host!r}; set ASYNCGRPO_TOKEN to serve on other addresses"
        )


def serve(
    run_name: str, host: str, port: int, insecure_loopback: bool = False, settings: ProxySettings | None = None
) -> None:
    """Run the coordinator of ``run_name`` until SIGINT/SIGTERM; ``settings`` as the caller already read them
    (else from ``ASYNCGRPO_*``)."""
    import uvicorn
    from redis import Redis

    from proxy.coordinator.dispatch import CeleryDispatcher
    from proxy.protocol.log_setup import configure_logging
    from proxy.storage.bucket import open_bucket

    settings = settings or ProxySettings()
    token = settings.token_value()
    try:
        check_can_serve(host, token, insecure_loopback)
        if not settings.bucket:
            raise ProxyStartupError(
                "ASYNCGRPO_BUCKET is not set: give the run's bucket (file:///path or s3://b/prefix)"
            )
    except ProxyStartupError as error:
        raise SystemExit(f"asyncgrpo proxy: {error}") from error
    configure_logging(role="proxy", run=run_name)
    bucket = open_bucket(settings.bucket, s3_endpoint_url=settings.s3_endpoint_url)
    redis = Redis.from_url(settings.redis_url, decode_responses=True)
    coordinator = Coordinator.from_bucket(
        redis, bucket, run_name, CeleryDispatcher(settings.redis_url), worker_alive_s=settings.worker_alive_s
    )
    outcome = coordinator.ensure_state()
    log.info(
        "proxy.starting",
        run=run_name,
        host=host,
        port=port,
        state=outcome,
        current_version=coordinator.current_version(),
        auth="off (loopback)" if not token else "bearer",
    )
    app = create_app(coordinator, token, tick_s=settings.tick_s)
    # access_log off: the middleware already logs one line per request (proxy.request), with its duration.
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, timeout_graceful_shutdown=10
    )
    releasing_server(config, app.state.version_watch).run()
