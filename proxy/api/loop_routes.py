"""The heartbeat answered on the event loop: the request a fleet sends most.

Every worker sends one every 5 s, sampling or idle, so 1,000 generate workers send 200 a second. Through a
FastAPI route each one paid for the dependency machinery's validation and a hop to a handler thread: most of the
proxy's CPU at that fleet size (``benchmarks/bench_fleet.py``). ``LoopRoutes`` answers it in the ASGI stack
instead, inside the token check, the body limit, the timing and the lease guard: the body is validated by the
route's own model, the script runs on an asyncio Redis client, and the answer is the route's.

Anything off that one path (a query string, a body that is not JSON or that the model refuses, any error) goes
on to the route unchanged, so the route stays the one definition of the endpoint, of its errors and of
``/openapi.json``. Without a Redis URL (``create_app(redis_url=None)``, tests of the routes) every request does.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from pydantic import ValidationError
from redis.asyncio import BlockingConnectionPool
from redis.asyncio import Redis as AsyncRedis
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asyncgrpo.protocol.schemas import HeartbeatRequest, HeartbeatResult
from proxy.api.edge import replay
from proxy.coordinator.scripts import RECORD_HEARTBEAT, AsyncBoundScript
from proxy.coordinator.service import Coordinator

log = structlog.get_logger()

HEARTBEAT_PATH = "/v1/workers/heartbeat"
LOOP_REDIS_CONNECTIONS = 64
"""Connections of the event loop's Redis client: its calls are one short script each, never a bucket put."""
LOOP_REDIS_WAIT_S = 20.0
"""How long a call waits for one of them before it fails (and the route answers instead)."""


class Heartbeats:
    """The event loop's heartbeat: its Redis client, opened and closed with the app (on its loop)."""

    def __init__(self, coordinator: Coordinator, poke: Callable[[], None]) -> None:
        self.coordinator = coordinator
        self.poke = poke
        self.answer = HeartbeatResult().model_dump_json().encode()
        self.route: object = None
        """The FastAPI route of the path, put in the scope so the timing middleware labels both alike."""
        self.served = 0
        """Heartbeats answered here (the tests and the benchmarks read it)."""
        self._pool: BlockingConnectionPool | None = None
        self._record: AsyncBoundScript | None = None

    @property
    def open(self) -> bool:
        return self._record is not None

    async def start(self, redis_url: str) -> None:
        self._pool = BlockingConnectionPool.from_url(
            redis_url, decode_responses=True, max_connections=LOOP_REDIS_CONNECTIONS, timeout=LOOP_REDIS_WAIT_S
        )
        self._record = self.coordinator.store.bind_async(AsyncRedis(connection_pool=self._pool), RECORD_HEARTBEAT)

    async def stop(self) -> None:
        self._record = None
        if self._pool is not None:
            await self._pool.disconnect()
            self._pool = None

    async def record(self, report: HeartbeatRequest) -> None:
        assert self._record is not None
        if await self.coordinator.heartbeat_on_loop(report, self._record):
            self.poke()  # a restarted worker: end its old incarnation's work in a round now, not at the next tick
        self.served += 1


class LoopRoutes:
    """ASGI: ``POST /v1/workers/heartbeat`` answered by ``heartbeats`` when it can, else by the app."""

    def __init__(self, app: ASGIApp, *, heartbeats: Heartbeats) -> None:
        self.app = app
        self.heartbeats = heartbeats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] != HEARTBEAT_PATH
            or scope.get("query_string")  # the route refuses unknown query parameters
            or not _json(scope)
            or not self.heartbeats.open
        ):
            await self.app(scope, receive, send)
            return
        messages = await _body(receive)
        try:
            report = HeartbeatRequest.model_validate_json(b"".join(m.get("body", b"") for m in messages))
            await self.heartbeats.record(report)
        except ValidationError:
            await self.app(scope, replay(messages, receive), send)  # the route's 422, with its body
            return
        except Exception as error:  # Redis down or slow: the route answers (and maps the error) as before
            log.info("proxy.loop_heartbeat_passed_on", error=str(error))
            await self.app(scope, replay(messages, receive), send)
            return
        scope["route"] = self.heartbeats.route
        body = self.heartbeats.answer
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


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
