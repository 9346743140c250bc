"""The proxy's HTTP API (FastAPI) and ``serve()``, which ``asyncgrpo proxy`` calls.

Every POST/DELETE needs ``Authorization: Bearer <ASYNCGRPO_TOKEN>`` (checked with ``hmac.compare_digest``
before the body is even parsed): 401 otherwise, and nothing changes. A malformed body is a 422 and changes
nothing. Refusals are JSON ``{"error": <code>, "detail": <sentence>, ...}`` with these codes:

=====  ============  =====================================================================
409    stale         the rollout is too old; its groups were counted and requeued
409    not_ready     no version published yet (leases)
409    conflict      a publish refused (CAS lost, manifest missing or mismatching, ...)
410    lease_lost    the lease expired or is unknown
410    cancelled     the generate task was cancelled or is unknown; its groups were requeued
400    bad_request   a submission that does not match its task
404    not_found     no such step
422    bad_request   the body does not match the schema
503    unavailable   Redis or the bucket is unreachable right now; retry
401    unauthorized  missing or wrong bearer token
=====  ============  =====================================================================

Each refusal is counted in ``asyncgrpo_http_errors_total{error=<code>}``.

The housekeeping loop (``Coordinator.tick``) runs as an asyncio task of the app's lifespan, every
``tick_s`` seconds and right after each submit and publish.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Annotated, Any

import structlog
from fastapi import Body, FastAPI, Path, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

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
from proxy.protocol.schemas import (
    ID_PATTERN,
    HeartbeatRequest,
    HeartbeatResult,
    LeaseGrant,
    LeaseRequest,
    PublishRequest,
    PublishResult,
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
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Polled by dashboards and people: their request lines are logged at debug level only.
_QUIET_ROUTES = frozenset({"/metrics", "/healthz", "/v1/status", "/v1/workers"})


class ProxyStartupError(Exception):
    """The proxy cannot start as configured; the message says what to change."""


def _error_body(status: int, error: str, detail: str, **extra: Any) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": error, "detail": detail, **extra})


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def _install_error_handlers(app: FastAPI, metrics: ProxyMetrics) -> None:
    def _error(status: int, error: str, detail: str, **extra: Any) -> JSONResponse:
        metrics.count_http_error(error)
        return _error_body(status, error, detail, **extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(
            422, "bad_request", "the request body does not match the schema", errors=jsonable_encoder(exc.errors())
        )

    @app.exception_handler(StaleRolloutError)
    async def _stale(_: Request, exc: StaleRolloutError) -> JSONResponse:
        return _error(
            409,
            "stale",
            str(exc),
            version=exc.sample_version,
            current_version=exc.current,
            max_staleness=exc.max_staleness,
        )

    @app.exception_handler(NoVersionYet)
    async def _not_ready(_: Request, exc: NoVersionYet) -> JSONResponse:
        return _error(409, "not_ready", str(exc))

    @app.exception_handler(PublishConflict)
    async def _conflict(_: Request, exc: PublishConflict) -> JSONResponse:
        return _error(409, "conflict", str(exc), reason=_snake(type(exc).__name__), current_version=exc.current_version)

    @app.exception_handler(LeaseLostError)
    async def _lease_lost(_: Request, exc: LeaseLostError) -> JSONResponse:
        return _error(410, "lease_lost", str(exc))

    @app.exception_handler(TaskCancelled)
    async def _cancelled(_: Request, exc: TaskCancelled) -> JSONResponse:
        return _error(410, "cancelled", str(exc))

    @app.exception_handler(BadRollout)
    async def _bad(_: Request, exc: BadRollout) -> JSONResponse:
        return _error(400, "bad_request", str(exc))

    @app.exception_handler(StepNotFound)
    async def _not_found(_: Request, exc: StepNotFound) -> JSONResponse:
        return _error(404, "not_found", str(exc))

    async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
        log.warning("proxy.unavailable", error=str(exc), kind=type(exc).__name__)
        return _error(503, "unavailable", f"{type(exc).__name__}: {exc}; retry shortly")

    for kind in (SnapshotFailed, StateMissing, RedisError, BucketError):
        app.add_exception_handler(kind, _unavailable)


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
    metrics.watch_state(coordinator.status, coordinator.run_limits())
    expected = token.encode() if token else None

    @app.middleware("http")
    async def authorize_and_time(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        if expected is not None and request.method in _STATE_CHANGING:
            header = request.headers.get("authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
                metrics.count_http_error("unauthorized")
                response: Response = _error_body(401, "unauthorized", "missing or wrong bearer token (ASYNCGRPO_TOKEN)")
                response.headers["WWW-Authenticate"] = "Bearer"
                # Refused before routing: one fixed label, so a scanner cannot grow the label set.
                metrics.http_seconds.labels("unauthorized", request.method).observe(time.perf_counter() - started)
                return response
        response = await call_next(request)
        route = getattr(request.scope.get("route"), "path", "unmatched")
        seconds = time.perf_counter() - started
        metrics.http_seconds.labels(route, request.method).observe(seconds)
        # One line per request with its duration; scrapes and health checks only at debug level.
        log_line = log.debug if route in _QUIET_ROUTES else log.info
        log_line("proxy.request", method=request.method, route=route, status=response.status_code, seconds=seconds)
        return response

    _install_error_handlers(app, metrics)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        try:
            current = coordinator.current_version()
        except RedisError as error:
            metrics.count_http_error("unavailable")
            return _error_body(503, "unavailable", f"Redis unreachable: {error}")
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

    @app.delete("/v1/leases/{lease_id}")
    def release_lease(lease_id: LeaseId) -> dict[str, bool]:
        return {"released": coordinator.release(lease_id)}

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


def serve(run_name: str, host: str, port: int, insecure_loopback: bool = False) -> None:
    """Run the coordinator of ``run_name`` until SIGINT/SIGTERM (settings from ``ASYNCGRPO_*``)."""
    import uvicorn
    from redis import Redis

    from proxy.api.settings import ProxySettings
    from proxy.coordinator.dispatch import CeleryDispatcher
    from proxy.protocol.log_setup import configure_logging
    from proxy.storage.bucket import open_bucket

    settings = ProxySettings()
    token = settings.token.get_secret_value() if settings.token else None
    try:
        check_can_serve(host, token, insecure_loopback)
        if not settings.bucket:
            raise ProxyStartupError(
                "ASYNCGRPO_BUCKET is not set: give the run's bucket (file:///path or s3://b/prefix)"
            )
    except ProxyStartupError as error:
        raise SystemExit(f"asyncgrpo proxy: {error}") from error
    configure_logging(role="proxy", run=run_name)
    bucket = open_bucket(settings.bucket)
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
    uvicorn.run(app, host=host, port=port, log_config=None, timeout_graceful_shutdown=10)
