"""The fleet's requests answered on the event loop: heartbeats, leases, renewals, submits and the long poll.

A generate worker sends a heartbeat every 5 s, a lease, maybe renewals and a submit per task, and holds a long
poll open that every publish answers: at 1,000 workers that is hundreds of requests a second, most of the proxy's.
Through a FastAPI route each one paid for the dependency machinery (parameters, the response model) and, for
synchronous handlers, a hop to a handler thread and back (``benchmarks/bench_fleet.py --py-spy``). ``LoopRoutes``
answers them in the ASGI stack instead, inside the leadership guard, the token check, the body limit and the
timing: the body is validated by the route's own model, the scripts run on an asyncio Redis client, a submit
waits for the group commit on a future (``SnapshotWriter.write_through_on_loop``), and the answer is the route's
model. A refusal or a fault is answered with the routes' own error answers (``proxy.api.edge``).

Anything off those paths (a query string a route does not take, a body that is not JSON or that the model
refuses, a path parameter the route would refuse) goes on to the route unchanged, so the route stays the one
definition of the endpoint, of its schema errors and of ``/openapi.json``. So does a request that found no state
in Redis (the route rebuilds it, then answers) or whose Redis call failed: the route runs it again, as the
worker's retry would. Without a Redis URL (``create_app(redis_url=None)``, tests of the routes) every request
but the long poll goes to its route.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl

import structlog
from pydantic import BaseModel, ValidationError
from redis.asyncio import BlockingConnectionPool
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asyncgrpo.protocol.schemas import (
    ID_PATTERN,
    HeartbeatRequest,
    HeartbeatResult,
    LeaseRequest,
    RenewRequest,
    RolloutSubmission,
)
from proxy.api.edge import fault_answer, is_refusal, refusal_answer, replay
from proxy.api.version_watch import MAX_WAIT_S, VersionWatch
from proxy.coordinator.redis_store import LoopScripts
from proxy.coordinator.scripts import StateMissing
from proxy.coordinator.service import Coordinator

log = structlog.get_logger()

HEARTBEAT_PATH = "/v1/workers/heartbeat"
LEASES_PATH = "/v1/leases"
RENEW_PATH = "/v1/leases/{lease_id}/renew"
ROLLOUTS_PATH = "/v1/rollouts"
LATEST_PATH = "/v1/versions/latest"
LOOP_PATHS = (HEARTBEAT_PATH, LEASES_PATH, RENEW_PATH, ROLLOUTS_PATH, LATEST_PATH)
"""The routes answered here (by their templates, as the timing labels them)."""
LOOP_REDIS_CONNECTIONS = 64
"""Connections of the event loop's Redis client: its calls are one short script each, never a bucket put."""
LOOP_REDIS_WAIT_S = 20.0
"""How long a call waits for one of them before it fails (and the route answers instead)."""
LOOP_REDIS_CONNECT_S = 5.0
"""How long the client waits for a new connection (it has no socket timeout: ``ASYNC_CALL_TIMEOUT_S`` bounds calls)."""

_RENEW = re.compile(r"/v1/leases/([^/]+)/renew")
_ID = re.compile(ID_PATTERN)
_INTEGER = re.compile(r"-?[0-9]{1,18}")
_DECIMAL = re.compile(r"[0-9]{1,9}(\.[0-9]{1,9})?")
"""The plain forms of the long poll's numbers; any other spelling is the route's to parse or refuse."""


class PassOn(Exception):
    """The request is the route's to answer (off the loop's path)."""


class LoopAnswers:
    """What answers the fleet's requests on the event loop: its Redis client and scripts, opened and closed with
    the app (on its loop), the version watch, and what was answered here."""

    def __init__(self, coordinator: Coordinator, watch: VersionWatch, poke: Callable[[], None]) -> None:
        self.coordinator = coordinator
        self.watch = watch
        self.poke = poke
        self.served: Counter[str] = Counter()
        """Requests answered here, by route template (the tests and the benchmarks read it)."""
        self.routes: dict[str, object] = {}
        """The FastAPI route of each path, put in the scope so the timing middleware labels both alike."""
        self.refused: Counter[str] = Counter()
        """Refusals answered here, by route template."""
        self._pool: BlockingConnectionPool | None = None
        self._scripts: LoopScripts | None = None

    @property
    def open(self) -> bool:
        return self._scripts is not None

    @property
    def scripts(self) -> LoopScripts:
        assert self._scripts is not None, "the loop's Redis client is not open"
        return self._scripts

    async def start(self, redis_url: str) -> None:
        self._pool = BlockingConnectionPool.from_url(
            redis_url,
            decode_responses=True,
            max_connections=LOOP_REDIS_CONNECTIONS,
            timeout=LOOP_REDIS_WAIT_S,
            # Each call is bounded by its script (ASYNC_CALL_TIMEOUT_S) instead: a socket timeout makes redis-py
            # write every command through asyncio.wait_for, a task each.
            socket_timeout=None,
            socket_connect_timeout=LOOP_REDIS_CONNECT_S,
        )
        self._scripts = self.coordinator.store.bind_loop(AsyncRedis(connection_pool=self._pool))

    async def stop(self) -> None:
        pool, self._pool, self._scripts = self._pool, None, None
        if pool is not None:
            await pool.disconnect()

    def endpoint(self, scope: Scope) -> _Endpoint | None:
        """What answers the request here, or None: the route."""
        method, path = scope["method"], scope["path"]
        if method == "GET" and path == LATEST_PATH:
            query = scope.get("query_string", b"")
            return _Endpoint(LATEST_PATH, lambda _: self._latest(query))
        # Routes refuse unknown queries; FastAPI parses a body without a content type as JSON too.
        if method != "POST" or scope.get("query_string") or not _json(scope) or not self.open:
            return None
        if path == HEARTBEAT_PATH:
            return _Endpoint(HEARTBEAT_PATH, self._heartbeat)
        if path == LEASES_PATH:
            return _Endpoint(LEASES_PATH, self._lease)
        if path == ROLLOUTS_PATH:
            return _Endpoint(ROLLOUTS_PATH, self._submit)
        renew = _RENEW.fullmatch(path)
        if renew is not None and _ID.fullmatch(lease_id := renew.group(1)):
            return _Endpoint(RENEW_PATH, lambda body: self._renew(lease_id, body))
        return None

    async def _heartbeat(self, body: bytes) -> BaseModel:
        report = HeartbeatRequest.model_validate_json(body)
        if await self.coordinator.heartbeat_on_loop(report, self.scripts):
            self.poke()  # a restarted worker: end its old incarnation's work in a round now, not at the next tick
        return HeartbeatResult()

    async def _lease(self, body: bytes) -> BaseModel:
        request = LeaseRequest.model_validate_json(body)
        return await self.coordinator.lease_on_loop(
            request.worker_id, request.task_id, request.incarnation or "", self.scripts
        )

    async def _renew(self, lease_id: str, body: bytes) -> BaseModel:
        RenewRequest.model_validate_json(body)  # no body at all, which the route takes too, is the route's
        return await self.coordinator.renew_on_loop(lease_id, self.scripts)

    async def _submit(self, body: bytes) -> BaseModel:
        submission = RolloutSubmission.model_validate_json(body)
        try:
            return await self.coordinator.submit_on_loop(submission, self.scripts)
        finally:
            self.poke()  # a round now: the buffer may complete a step

    async def _latest(self, query: bytes) -> BaseModel:
        after, wait_s = _long_poll_query(query)
        return await self.watch.wait_newer(after, wait_s)


@dataclass(frozen=True)
class _Endpoint:
    path: str
    """The route's template: its label, and how ``LoopAnswers.routes`` finds the route."""
    answer: Callable[[bytes], Awaitable[BaseModel]]
    """The answer from the request's body; raises PassOn (or anything) to hand the request to the route."""


class LoopRoutes:
    """ASGI: the fleet's requests (``LOOP_PATHS``) answered by ``answers`` when they can be, else by the app."""

    def __init__(self, app: ASGIApp, *, answers: LoopAnswers) -> None:
        self.app = app
        self.answers = answers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.answers.endpoint(scope) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        messages = await _body(receive) if scope["method"] == "POST" else []
        answers = self.answers
        try:
            answer = await endpoint.answer(b"".join(m.get("body", b"") for m in messages))
        except (PassOn, ValidationError):
            await self.app(scope, replay(messages, receive), send)  # the route's answer, or its 422
            return
        except (StateMissing, RedisError, TimeoutError) as error:
            # Nothing changed (no state), or maybe something did and its reply was lost: the route runs the
            # request again through the coordinator's own client, rebuilding a lost state first, as a worker's
            # retry would (every request here may be repeated: a repeated submit is answered as a duplicate).
            log.info("proxy.loop_request_passed_on", path=endpoint.path, error=str(error), kind=type(error).__name__)
            await self.app(scope, replay(messages, receive), send)
            return
        except Exception as error:  # a refusal, or a fault: answered here, exactly as the route's handlers do
            scope["route"] = answers.routes.get(endpoint.path)
            refusal = is_refusal(error)
            metrics = answers.coordinator.metrics
            response = refusal_answer(error, metrics) if refusal else fault_answer(error, metrics)
            await response(scope, replay(messages, receive), send)
            answers.refused[endpoint.path] += refusal
            return
        scope["route"] = answers.routes.get(endpoint.path)
        body = answer.model_dump_json().encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        answers.served[endpoint.path] += 1


def _long_poll_query(query: bytes) -> tuple[int, float]:
    """``after`` and ``wait_s`` when the query spells them plainly and within the route's bounds; else PassOn."""
    try:
        pairs = parse_qsl(query.decode("ascii"), keep_blank_values=True, strict_parsing=bool(query))
    except (UnicodeDecodeError, ValueError):
        raise PassOn from None
    values = dict(pairs)
    if len(values) != len(pairs) or not set(values) <= {"after", "wait_s"}:
        raise PassOn  # a repeated or unknown parameter: the route's to answer
    after_text, wait_text = values.get("after", "-1"), values.get("wait_s", "0")
    if not _INTEGER.fullmatch(after_text) or not _DECIMAL.fullmatch(wait_text):
        raise PassOn
    after, wait_s = int(after_text), float(wait_text)
    if after < -1 or wait_s > MAX_WAIT_S:
        raise PassOn
    return after, wait_s


def _json(scope: Scope) -> bool:
    """Whether the request says its body is JSON (FastAPI also parses a body without a content type as JSON,
    and refuses other types: those go to the route)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";")[0].strip().lower() == b"application/json"
    return False


async def _body(receive: Receive) -> list[Message]:
    """Every body message (the body limit was enforced outside, by ``AuthAndTiming``)."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages
