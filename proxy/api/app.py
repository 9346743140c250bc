"""The proxy's HTTP API (FastAPI) and ``serve()``, which ``asyncgrpo proxy`` calls.

Every POST/DELETE needs ``Authorization: Bearer <ASYNCGRPO_TOKEN>`` (checked with ``hmac.compare_digest``
before the body is even parsed): 401 otherwise, and nothing changes. A malformed body is a 422 and changes
nothing. Refusals are JSON ``{"error": <code>, "detail": <sentence>, ...}``; the codes, their HTTP status and
the client exception each one raises are the table in ``asyncgrpo.protocol.errors``. This module decides which
coordinator refusal is which code (``REFUSAL_CODES``); a stale refusal also carries ``version``,
``current_version`` and ``max_staleness``, a publish conflict its ``reason`` and ``current_version``.

Each refusal is counted in ``asyncgrpo_http_errors_total{error=<code>}``.

The housekeeping loop (``Coordinator.tick``) runs as an asyncio task of the app's lifespan, every
``tick_s`` seconds and right after each submit and publish. The eval tasks' routes
(``POST /v1/evals/{task_id}/lease`` and ``.../result``) are installed by ``install_eval_routes``.

``GET /v1/versions/latest``, the generate workers' long poll for new versions: ``proxy.api.version_watch``.

Start-up (``serve()``) checks, before anything listens; each is refused with what to change, unless a
setting allows it (see docs/operations.md):

- The token must be something a client can send exactly: printable ASCII without spaces (RFC 6750's token
  characters), so no header parser trims or mangles it. On an address other than loopback it must also be a
  secret: at least ``MIN_TOKEN_CHARS`` long, not a placeholder from the shipped examples, and not one
  character repeated. Without a token the proxy serves only on loopback with ``--insecure-loopback``.
- Redis ``maxmemory-policy`` must be ``noeviction``: an evicted key of the run's state loses admitted work
  (``ASYNCGRPO_ALLOW_REDIS_EVICTION=1`` starts anyway). Where ``CONFIG`` is disabled (some managed Redis),
  the proxy warns and goes on.
- The bucket must honour conditional writes: a throwaway key under the run's prefix is put twice with
  ``if_absent`` and swapped twice with ``put_if_match`` on one ETag; each second put must be refused
  (``ASYNCGRPO_ALLOW_UNCONDITIONAL_BUCKET=1`` starts anyway).
- The run's leadership (``proxy.coordinator.snapshot``): taken with an epoch above the snapshot's; held
  by another proxy, start-up is refused, or a stand-by waits for it.

Once serving, ``keep_leadership`` renews the leadership every third of its TTL. A proxy that finds it taken stops
coordinating at once: state-changing requests are refused (503), and the process stops itself (SIGTERM to
itself, then ``serve`` exits non-zero) so that systemd restarts it, as a stand-by if so configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Annotated

import structlog
from fastapi import Body, FastAPI, Path
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis import BlockingConnectionPool, Redis
from redis.exceptions import RedisError, ResponseError
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectChanged, ObjectExists, ObjectNotFound
from asyncgrpo.protocol.evals import EvalLeaseGrant, EvalLeaseRequest, EvalResultAnswer, EvalResultRequest
from asyncgrpo.protocol.schemas import (
    ID_PATTERN,
    CorruptReport,
    CorruptResult,
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
    StepFailureReport,
    StepFailureResult,
    StepStartRequest,
    StepStartResult,
    SubmitResult,
    TaskFailureReport,
    TaskFailureResult,
    VersionInfo,
    WorkersResponse,
)
from proxy.api.edge import (
    AUTH_REFUSAL,
    OPEN_PATHS,
    TOO_LARGE,
    UNAVAILABLE,
    AuthAndTiming,
    FleetDispatch,
    FleetRoute,
    QueryCheckedRoute,
    answer,
    error_body,
    install_error_handlers,
    routes_of,
)
from proxy.api.openapi import install_openapi
from proxy.api.settings import DEFAULT_MAX_BODY_BYTES, ProxySettings
from proxy.api.version_watch import install_version_watch, releasing_server
from proxy.coordinator.service import Coordinator
from proxy.coordinator.snapshot import Leadership, LeadershipHeld, LeadershipLost, snapshot_epoch
from proxy.tracking.forwarder import start_forwarding

log = structlog.get_logger()


# ---- start-up: the token, Redis, the bucket, leadership ----


class ProxyStartupError(Exception):
    """The proxy cannot start as configured; the message says what to change."""


MIN_TOKEN_CHARS = 32
"""``openssl rand -hex 32`` makes 64."""
TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
PLACEHOLDER_TOKENS = frozenset({"change-me-to-a-long-random-string"})
"""The example values shipped in deploy/ (a test keeps this list in step with deploy/asyncgrpo.env.example)."""
MAKE_ONE = "make one with `openssl rand -hex 32` and give the same value to the proxy and every worker"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def token_problem(token: str, *, public: bool) -> str | None:
    """Why ``token`` must not be served with (``public``: on a non-loopback address), or None."""
    if not token.strip():
        return "ASYNCGRPO_TOKEN is blank"
    if not TOKEN_PATTERN.match(token):
        return (
            "ASYNCGRPO_TOKEN holds characters a client cannot send exactly in `Authorization: Bearer` "
            "(only letters, digits and -._~+/ with trailing =)"
        )
    if not public:
        return None
    if token in PLACEHOLDER_TOKENS or "change-me" in token.lower() or "changeme" in token.lower():
        return "ASYNCGRPO_TOKEN is still the example's placeholder"
    if len(token) < MIN_TOKEN_CHARS:
        return f"ASYNCGRPO_TOKEN is {len(token)} characters long; at least {MIN_TOKEN_CHARS} are needed"
    if len(set(token)) < 8:
        return "ASYNCGRPO_TOKEN repeats too few characters to be a secret"
    return None


def check_can_serve(host: str, token: str | None, insecure_loopback: bool) -> None:
    """Refuse to serve without a usable token, except on a loopback address with --insecure-loopback."""
    if token is not None:
        problem = token_problem(token, public=not is_loopback(host))
        if problem:
            raise ProxyStartupError(f"{problem}: {MAKE_ONE}")
        return
    if not insecure_loopback:
        raise ProxyStartupError(
            f"ASYNCGRPO_TOKEN is not set: {MAKE_ONE}, or pass --insecure-loopback with --host 127.0.0.1 for a "
            "local test"
        )
    if not is_loopback(host):
        raise ProxyStartupError(
            f"--insecure-loopback is only allowed with a loopback --host (127.0.0.1, ::1, localhost), not "
            f"{host!r}; set ASYNCGRPO_TOKEN to serve on other addresses"
        )


def check_eviction_policy(redis: Redis, *, allow: bool) -> str | None:
    """Refuse a Redis that may evict the run's keys; returns the policy (None if CONFIG is disabled)."""
    try:
        reply = redis.config_get("maxmemory-policy")
    except ResponseError as error:
        log.warning(
            "proxy.redis_config_unavailable",
            error=str(error),
            hint="cannot check maxmemory-policy; make sure the Redis service is set to noeviction",
        )
        return None
    policy = str(reply.get("maxmemory-policy", "noeviction"))
    if policy != "noeviction":
        message = (
            f"Redis runs with maxmemory-policy {policy!r}: under memory pressure it evicts keys of the run's "
            "state and admitted work is lost. Set `maxmemory-policy noeviction` (redis.conf, or CONFIG SET), or "
            "set ASYNCGRPO_ALLOW_REDIS_EVICTION=1 to start anyway"
        )
        if not allow:
            raise ProxyStartupError(message)
        log.warning("proxy.redis_eviction_allowed", policy=policy)
    return policy


def check_conditional_writes(bucket: Bucket, run: str, *, allow: bool) -> bool:
    """Probe create-only writes and compare-and-swap puts with a throwaway key under the run's prefix; True if
    the store honours both."""
    key = bucket_keys.proxy_probe_key(run, uuid.uuid4().hex)
    ignored: list[str] = []
    try:
        bucket.put(key, b"probe", if_absent=True)
        with contextlib.suppress(ObjectExists):
            bucket.put(key, b"probe again", if_absent=True)
            ignored.append(
                f"a second put of {key} with If-None-Match: * succeeded: two trainers could overwrite "
                "one version's manifest"
            )
        _, etag = bucket.get_tagged(key)
        bucket.put_if_match(key, b"probe swapped", etag)
        with contextlib.suppress(ObjectChanged):
            bucket.put_if_match(key, b"probe swapped twice", etag)
            ignored.append(
                f"a put of {key} with If-Match on an ETag it no longer had succeeded: a proxy paused "
                "past its leadership's TTL could overwrite its successor's snapshot"
            )
    finally:
        bucket.delete(key)
    if ignored:
        message = (
            f"the bucket {bucket.url} ignores conditional writes ({'; '.join(ignored)}). Use a store that honours "
            "them (AWS S3, SeaweedFS, MinIO recent), or set ASYNCGRPO_ALLOW_UNCONDITIONAL_BUCKET=1 to start anyway"
        )
        if not allow:
            raise ProxyStartupError(message)
        log.warning("proxy.unconditional_bucket_allowed", bucket=bucket.url, ignored=ignored)
    return not ignored


def take_leadership(
    leadership: Leadership, bucket: Bucket, *, standby: bool, sleep: Callable[[float], object] = time.sleep
) -> int:
    """Take the run's leadership with an epoch above the bucket snapshot's; returns the epoch. Held by
    another proxy: refuse (``ProxyStartupError``), or with ``standby`` wait until it lapses."""
    with contextlib.suppress(ObjectNotFound):
        leadership.raise_floor(snapshot_epoch(bucket.get(bucket_keys.proxy_snapshot_key(leadership.run))))
    announced = False
    while True:
        try:
            return leadership.acquire()
        except LeadershipHeld as error:
            if not standby:
                raise ProxyStartupError(str(error)) from error
            if not announced:
                log.warning("proxy.standby_waiting", run=leadership.run, holder=error.holder.describe())
                announced = True
        sleep(leadership.renew_every_s)


async def keep_leadership(leadership: Leadership, stop: Callable[[], object]) -> None:
    """Renew the leadership every third of its TTL until it is lost; then call ``stop`` once and return."""
    while True:
        try:
            await asyncio.to_thread(leadership.confirm)
        except LeadershipLost as error:
            log.critical("proxy.stopping_leadership_lost", run=leadership.run, error=str(error))
            stop()
            return
        except RedisError as error:  # Redis away: nobody else can take the leadership either; retry
            log.warning("proxy.leadership_renew_failed", run=leadership.run, error=str(error))
        await asyncio.sleep(leadership.renew_every_s)


def stop_this_process() -> None:
    """Ask uvicorn to shut down as on SIGTERM; ``serve`` then exits non-zero since the leadership is lost."""
    os.kill(os.getpid(), signal.SIGTERM)


def start_checks(redis: Redis, bucket: Bucket, run: str, settings: ProxySettings, *, standby: bool) -> Leadership:
    """Every start-up check, then the run's leadership (waiting for it if ``standby``); raises
    ``ProxyStartupError`` with what to change."""
    check_eviction_policy(redis, allow=settings.allow_redis_eviction)
    check_conditional_writes(bucket, run, allow=settings.allow_unconditional_bucket)
    leadership = Leadership(redis, run, ttl_s=settings.proxy_leadership_ttl_s)
    take_leadership(leadership, bucket, standby=standby or settings.proxy_standby)
    return leadership


CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class LeadershipGuard:
    """An ASGI middleware: once the leadership is lost, every state-changing request is refused (``refuse``).

    Plain ASGI rather than ``@app.middleware("http")``, whose wrapper runs each request through extra tasks
    and a streamed response: at a thousand workers that was 7 % of the proxy's CPU
    (``benchmarks/bench_fleet.py --py-spy``)."""

    def __init__(self, app: ASGIApp, *, leadership: Leadership | None, refuse: Callable[[str], Response]) -> None:
        self.app = app
        self.leadership = leadership
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        leadership = self.leadership
        # Only the methods of state-changing routes: any other one is routed on, to be answered 405 or 404.
        lost = leadership.lost if leadership is not None else None
        if lost is not None and scope["type"] == "http" and scope["method"] in CHANGING_METHODS:
            refusal = self.refuse(f"this proxy lost the run's leadership to {lost.describe()}; retry shortly")
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


TaskId = Annotated[str, Path(pattern=ID_PATTERN)]


# ---- the eval tasks' routes, and the app ----


def install_eval_routes(app: FastAPI, coordinator: Coordinator, poke: Callable[[], None]) -> None:
    """Add the two routes, and the eval gauges when the run evaluates. ``poke``: run a housekeeping round
    soon (a result may complete a version, whose record the round writes)."""
    if coordinator.evals.enabled:
        evals = coordinator.evals
        coordinator.metrics.watch_evals(lambda: (evals.pending_count(), evals.latest()))

    @app.post("/v1/evals/{task_id}/lease", response_model=EvalLeaseGrant)
    def grant_eval_lease(task_id: TaskId, request: EvalLeaseRequest) -> EvalLeaseGrant:
        return coordinator.eval_lease(request.worker_id, task_id, request.incarnation or "")

    @app.post("/v1/evals/{task_id}/result", response_model=EvalResultAnswer)
    def record_eval_result(task_id: TaskId, request: EvalResultRequest) -> EvalResultAnswer:
        try:
            return coordinator.eval_result(task_id, request)
        finally:
            poke()


LeaseId = Annotated[str, Path(pattern=ID_PATTERN)]
TaskId = Annotated[str, Path(pattern=ID_PATTERN)]
KEEP_ALIVE_S = 65
"""Seconds the proxy keeps an idle connection (uvicorn's default is 5): longer than the workers' client keeps
one (``asyncgrpo.protocol.client.KEEP_ALIVE_S``), so a heartbeat every 5 s reuses its connection, and longer
than the usual 60 s idle timeout of load balancers, so the proxy is never the side that drops one they reuse."""
ROUTE_THREADS = 40
"""anyio's default thread limit, which runs the synchronous routes (the trainer's, the operator's, the evals'):
FastAPI's own default, stated here because the Redis pool below is sized on it."""
REDIS_CONNECTIONS = ROUTE_THREADS + 64
"""The synchronous client's connections: one per route thread, and room for the housekeeping round, the long
polls' reads and the trackers. A full pool makes a call wait (``REDIS_CONNECTION_WAIT_S``) rather than refuse
it, as redis-py 8's default pool does at once ("Too many connections"). The fleet's requests have a client of
their own on the event loop (``proxy.coordinator.fleet``)."""
REDIS_CONNECTION_WAIT_S = 20.0
"""How long a call waits for a free connection beyond ``REDIS_CONNECTIONS`` before it fails."""


def proxy_redis(url: str) -> Redis:
    """The proxy's Redis client: a pool as large as the threads that use it, which waits rather than refuses."""
    pool = BlockingConnectionPool.from_url(
        url, decode_responses=True, max_connections=REDIS_CONNECTIONS, timeout=REDIS_CONNECTION_WAIT_S
    )
    return Redis(connection_pool=pool)


def create_app(
    coordinator: Coordinator,
    token: str | None,
    *,
    tick_s: float = 0.25,
    run_loop: bool = True,
    stop_on_lost_leadership: Callable[[], object] = stop_this_process,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics_need_token: bool = False,
    redis_url: str | None = None,
) -> FastAPI:
    """The API of one run. ``token=None`` disables auth (only ``serve`` on loopback may do that).
    ``run_loop=False`` leaves ``tick()`` to the caller (tests). With a ``coordinator.leadership``, it is
    renewed in the background and ``stop_on_lost_leadership`` is called once it is lost. ``max_body_bytes`` and
    ``metrics_need_token``: ``ProxySettings``. ``redis_url``: the coordinator's Redis, for the fleet's asyncio
    client (``proxy.coordinator.fleet``; None: the server of the coordinator's own client)."""
    wake = asyncio.Event()
    loop_holder: dict[str, asyncio.AbstractEventLoop] = {}

    async def housekeeping() -> None:
        while coordinator.leadership is None or coordinator.leadership.lost is None:
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
        tasks = [asyncio.create_task(housekeeping())] if run_loop else []
        if coordinator.leadership is not None:  # one live proxy per run (proxy.api.app)
            tasks.append(asyncio.create_task(keep_leadership(coordinator.leadership, stop_on_lost_leadership)))
        await fleet.open(redis_url)
        try:
            yield
        finally:
            await fleet.close()
            for task in tasks:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task

    def poke() -> None:
        """Run a housekeeping round soon (called on the loop or from a route's thread)."""
        loop = loop_holder.get("loop")
        if loop is not None and run_loop:
            loop.call_soon_threadsafe(wake.set)

    app = FastAPI(
        title="asyncgrpo proxy",
        version="1",
        description=__doc__,
        lifespan=lifespan,
        # FastAPI's own OpenTelemetry, off: the proxy's metrics are its Prometheus ones (/metrics), and the check
        # whether a provider is configured cost every request a few microseconds.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.router.route_class = QueryCheckedRoute  # before any route: each refuses a query it does not take
    app.state.coordinator = coordinator
    metrics = coordinator.metrics
    metrics.watch_state(coordinator.gauges, coordinator.run_limits())  # counts only: cheap per scrape
    metrics.watch_fleet(coordinator.fleet)
    expected = token.encode() if token else None

    def unavailable(detail: str) -> Response:
        metrics.count_http_error(UNAVAILABLE)
        return error_body(UNAVAILABLE, detail)

    def refuse(code: str) -> Response:
        metrics.count_http_error(code)
        if code == TOO_LARGE:
            return error_body(code, f"the request body is over {max_body_bytes} bytes (ASYNCGRPO_MAX_BODY_BYTES)")
        response = error_body(AUTH_REFUSAL, "missing or wrong bearer token (ASYNCGRPO_TOKEN)")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    open_paths = OPEN_PATHS - {"/metrics"} if metrics_need_token else OPEN_PATHS
    # GET /v1/versions/latest, the generate workers' long poll for new versions (proxy.api.version_watch).
    version_watch = install_version_watch(app, coordinator)
    fleet = coordinator.fleet_requests  # awaited on this loop (proxy.coordinator.fleet)
    # Innermost, after the guard, the token and the limit: the fleet's requests answered by their routes at once.
    app.add_middleware(FleetDispatch, app=app)
    app.add_middleware(
        AuthAndTiming,
        token=expected,
        metrics=metrics,
        refuse=refuse,
        max_body_bytes=max_body_bytes,
        open_paths=open_paths,
    )
    app.add_middleware(LeadershipGuard, leadership=coordinator.leadership, refuse=unavailable)

    install_error_handlers(app, metrics)

    # ---- the fleet's requests: awaited on the loop, none waits in a thread; answered serialized once; first, as the
    # router tries routes in order; each validated in one pass (FleetRoute) ----

    with routes_of(app, FleetRoute):

        @app.post("/v1/workers/heartbeat", response_model=HeartbeatResult)
        async def heartbeat(report: HeartbeatRequest) -> Response:
            if await fleet.heartbeat(report):
                poke()  # a restarted worker: end its old incarnation's work in a round now, not at the next tick
            return answer(HeartbeatResult())

        @app.post("/v1/leases", response_model=LeaseGrant)
        async def grant_lease(request: LeaseRequest) -> Response:
            return answer(await fleet.lease(request.worker_id, request.task_id, request.incarnation or ""))

        @app.post("/v1/rollouts", response_model=SubmitResult)
        async def submit_rollout(submission: RolloutSubmission) -> Response:
            try:
                return answer(await fleet.submit(submission))
            finally:
                poke()  # a round now: the buffer may complete a step

        @app.post("/v1/leases/{lease_id}/renew", response_model=LeaseGrant)
        async def renew_lease(lease_id: LeaseId, _: Annotated[RenewRequest | None, Body()] = None) -> Response:
            return answer(await fleet.renew(lease_id))

        @app.delete("/v1/leases/{lease_id}", response_model=ReleaseResult)
        async def release_lease(lease_id: LeaseId) -> Response:
            return answer(ReleaseResult(released=await fleet.release(lease_id)))

    # ---- the trainer's and the operator's requests: synchronous (FastAPI runs them in its threads) ----

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        try:
            current = coordinator.current_version()
        except RedisError as error:
            metrics.count_http_error(UNAVAILABLE)
            return error_body(UNAVAILABLE, f"Redis unreachable: {error}")
        return JSONResponse({"status": "ok", "run": coordinator.run, "current_version": current})

    @app.get("/metrics", response_class=PlainTextResponse)
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

    @app.post("/v1/tasks/{task_id}/failure", response_model=TaskFailureResult)
    def report_task_failure(task_id: TaskId, report: TaskFailureReport) -> TaskFailureResult:
        try:
            return coordinator.report_task_failure(task_id, report)
        finally:
            poke()

    @app.get("/v1/steps/{step}", response_model=StepBatch)
    def get_step(step: Annotated[int, Path(ge=0)]) -> StepBatch:
        return coordinator.get_step(step)

    @app.post("/v1/steps/{step}/start", response_model=StepStartResult)
    def start_step(step: Annotated[int, Path(ge=0)], request: StepStartRequest) -> StepStartResult:
        return coordinator.start_step(step, request)

    @app.post("/v1/steps/{step}/failure", response_model=StepFailureResult)
    def report_step_failure(step: Annotated[int, Path(ge=0)], report: StepFailureReport) -> StepFailureResult:
        try:
            return coordinator.report_step_failure(step, report)
        finally:
            poke()  # re-send or re-claim at once

    @app.post("/v1/versions", response_model=PublishResult)
    def publish_version(request: PublishRequest) -> PublishResult:
        try:
            return coordinator.publish(request)
        finally:
            version_watch.notify()
            poke()

    # ---- published versions: recorded sha and corruption reports (proxy.coordinator.steps) ----

    @app.get("/v1/versions/{version}", response_model=VersionInfo)
    def version_info(version: Annotated[int, Path(ge=0)]) -> VersionInfo:
        return coordinator.version_info(version)

    @app.post("/v1/versions/{version}/corrupt", response_model=CorruptResult)
    def report_corrupt(version: Annotated[int, Path(ge=0)], report: CorruptReport) -> CorruptResult:
        return coordinator.report_corrupt(version, report)

    install_eval_routes(app, coordinator, poke)  # POST /v1/evals/{task_id}/lease and .../result
    install_openapi(app, token_required=expected is not None, open_paths=open_paths)
    return app


def serve(
    run_name: str,
    host: str,
    port: int,
    settings: ProxySettings,
    insecure_loopback: bool = False,
    standby: bool = False,
) -> None:
    """Run the coordinator of ``run_name`` until SIGINT/SIGTERM; ``settings`` as the process's entry
    (``proxy.__main__``) read them. Exits non-zero if another proxy holds the run (unless ``standby``: wait for
    it) or takes it over while this one serves."""
    import uvicorn

    from asyncgrpo.bucket.backends import open_bucket
    from asyncgrpo.protocol.log_setup import configure_logging
    from proxy.coordinator.dispatch import CeleryDispatcher

    token = settings.token_value()
    try:
        check_can_serve(host, token, insecure_loopback)
        if not settings.bucket:
            raise ProxyStartupError(
                "ASYNCGRPO_BUCKET is not set: give the run's bucket (file:///path or s3://b/prefix)"
            )
    except ProxyStartupError as error:
        raise SystemExit(f"asyncgrpo proxy: {error}") from error
    configure_logging(log_format=settings.log_format, level=settings.log_level, role="proxy", run=run_name)
    bucket = open_bucket(settings.bucket, s3_endpoint_url=settings.s3_endpoint_url)
    redis = proxy_redis(settings.redis_url)
    try:
        leadership = start_checks(redis, bucket, run_name, settings, standby=standby)
    except ProxyStartupError as error:
        raise SystemExit(f"asyncgrpo proxy: {error}") from error
    coordinator = Coordinator.from_bucket(
        redis,
        bucket,
        run_name,
        CeleryDispatcher(settings.redis_url),
        worker_alive_s=settings.worker_alive_s,
        leadership=leadership,
        require_generate_worker=True,
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
        proxy_epoch=leadership.epoch,
    )
    app = create_app(
        coordinator,
        token,
        tick_s=settings.tick_s,
        max_body_bytes=settings.max_body_bytes,
        metrics_need_token=settings.metrics_need_token,
        redis_url=settings.redis_url,
    )
    # [tracking] report_to: its own threads, only while this proxy holds the run (proxy.tracking.forwarder).
    tracking = start_forwarding(
        coordinator.config,
        run_name,
        redis=redis,
        bucket=bucket,
        registry=coordinator.metrics.registry,
        keep_going=lambda: leadership.lost is None,
        on_progress=coordinator.store.mark_changed,  # the next tick snapshots it: it survives an empty Redis
    )
    # access_log off: the middleware already logs one line per request (proxy.request), with its duration.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    releasing_server(config, app.state.version_watch).run()
    tracking.stop()
    if leadership.lost is not None:  # non-zero, so that systemd restarts it (as a stand-by if so configured)
        raise SystemExit(f"asyncgrpo proxy: lost the leadership of run {run_name!r} to {leadership.lost.describe()}")
    leadership.release()  # a clean stop: a stand-by takes over at once
