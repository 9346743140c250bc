"""The fleet's requests: heartbeats, leases on adapter versions (grant, renew, release) and rollout submits.

A generate worker sends a heartbeat every 5 s, a lease, maybe renewals and a submit per task: at 1,000 workers
that is hundreds of requests a second, most of the proxy's. Each is answered one way, awaited on the server's
event loop: its script runs on one asyncio Redis client (``LoopScripts``), and a submit waits for the group
commit on a future (``SnapshotWriter.wait_durable``), never in a thread of its own. A request that finds no state
in Redis rebuilds it (in a thread: the rebuild reads the bucket) and runs again, once, as every other entry point
of the coordinator does.

The client belongs to the event loop that opened it (``open``, the app's lifespan). A call on another loop (a
test's own) opens one for that loop; it goes with the loop.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import quote

from redis import Redis
from redis.asyncio import BlockingConnectionPool
from redis.asyncio import Redis as AsyncRedis

from asyncgrpo.protocol.schemas import HeartbeatRequest, LeaseGrant, RolloutSubmission, SubmitResult
from proxy.coordinator.generate_tasks import InflightPacer
from proxy.coordinator.leases import Leases
from proxy.coordinator.redis_store import LoopScripts, RedisStore
from proxy.coordinator.rollouts import RolloutIntake
from proxy.coordinator.scripts import NotTaskHolder, StateMissing
from proxy.coordinator.workers import Workers

T = TypeVar("T")

FLEET_REDIS_CONNECTIONS = 64
"""Connections of the event loop's Redis client: its calls are one short script each, never a bucket put."""
FLEET_REDIS_WAIT_S = 20.0
"""How long a call waits for one of them before it fails (answered ``unavailable``: the worker retries)."""
FLEET_REDIS_CONNECT_S = 5.0
"""How long the client waits for a new connection (it has no socket timeout: ``ASYNC_CALL_TIMEOUT_S`` bounds calls)."""


def redis_url_of(redis: Redis) -> str:
    """The URL of the server a synchronous client (TCP) talks to, for an asyncio client of the same server."""
    kwargs = redis.connection_pool.connection_kwargs
    if "host" not in kwargs:
        raise ValueError("give the proxy's Redis URL (redis_url): its client does not connect over TCP")
    user, password = kwargs.get("username"), kwargs.get("password")
    auth = f"{quote(user or '', safe='')}:{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


class FleetRequests:
    """The fleet's requests of one run, awaited on an event loop (``proxy.api.app`` routes them)."""

    def __init__(
        self,
        store: RedisStore,
        leases: Leases,
        rollouts: RolloutIntake,
        workers: Workers,
        pacer: InflightPacer,
        ensure_state: Callable[[], object],
    ) -> None:
        """``ensure_state``: rebuild a missing state from the bucket (blocking: it runs in a thread)."""
        self.store = store
        self.leases = leases
        self.rollouts = rollouts
        self.workers = workers
        self.pacer = pacer
        self.ensure_state = ensure_state
        self.redis_url: str | None = None
        """The server of the asyncio clients (None: the store's client's, ``redis_url_of``)."""
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[BlockingConnectionPool, LoopScripts]]
        self._clients = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    async def open(self, redis_url: str | None = None) -> None:
        """Open this event loop's client (of ``redis_url``, else of the store's server)."""
        if redis_url is not None:
            self.redis_url = redis_url
        self._scripts()

    async def close(self) -> None:
        """Close this event loop's client (the app's lifespan ends)."""
        with self._lock:
            opened = self._clients.pop(asyncio.get_running_loop(), None)
        if opened is not None:
            await opened[0].disconnect()

    def _scripts(self) -> LoopScripts:
        loop = asyncio.get_running_loop()
        with self._lock:
            opened = self._clients.get(loop)
            if opened is None:
                pool = BlockingConnectionPool.from_url(
                    self.redis_url or redis_url_of(self.store.redis),
                    decode_responses=True,
                    max_connections=FLEET_REDIS_CONNECTIONS,
                    timeout=FLEET_REDIS_WAIT_S,
                    # Each call is bounded by its script (ASYNC_CALL_TIMEOUT_S) instead: a socket timeout makes
                    # redis-py write every command through asyncio.wait_for, a task each.
                    socket_timeout=None,
                    socket_connect_timeout=FLEET_REDIS_CONNECT_S,
                )
                opened = (pool, self.store.bind_loop(AsyncRedis(connection_pool=pool)))
                self._clients[loop] = opened
            return opened[1]

    async def _rebuilding(self, call: Callable[[LoopScripts], Awaitable[T]]) -> T:
        """``call``; if its script found no state (Redis flushed or restarted empty), rebuild it and call again."""
        scripts = self._scripts()
        try:
            return await call(scripts)
        except StateMissing:
            await asyncio.to_thread(self.ensure_state)
        try:
            return await call(scripts)
        except StateMissing as error:
            raise StateMissing(f"Redis holds no state for run {self.store.run!r} even after a rebuild") from error

    async def heartbeat(self, report: HeartbeatRequest) -> bool:
        """Record a heartbeat; True if it came from a restarted worker (a new incarnation of its id), whose old
        incarnation's work the next round ends. It needs no run state (only the worker records)."""
        return await self.workers.heartbeat(report, self._scripts())

    async def lease(self, worker_id: str, task_id: str, incarnation: str = "") -> LeaseGrant:
        """Lease the current version for a task in flight. ``incarnation``: of the worker process; a newer one
        of ``worker_id`` ends the task (``workers``)."""
        grant = await self._rebuilding(lambda scripts: self.leases.grant(worker_id, task_id, incarnation, scripts))
        self.pacer.leased(task_id)
        return grant

    async def renew(self, lease_id: str) -> LeaseGrant:
        return await self._rebuilding(lambda scripts: self.leases.renew(lease_id, scripts))

    async def release(self, lease_id: str) -> bool:
        return await self._rebuilding(lambda scripts: self.leases.release(lease_id, scripts, ends_hold=True))

    async def submit(self, submission: RolloutSubmission) -> SubmitResult:
        """Admit a rollout iff it is fresh, durable in the bucket before it returns; raises StaleRolloutError,
        TaskCancelled, BadRollout, NotTaskHolder."""
        return await self._rebuilding(lambda scripts: self._submit(submission, scripts))

    async def _submit(self, submission: RolloutSubmission, scripts: LoopScripts) -> SubmitResult:
        release = submission.lease_id
        try:
            result = await self.rollouts.submit(submission, scripts)
        except NotTaskHolder:
            release = None  # the lease may be another worker's: a refused submission changes nothing
            raise
        finally:
            if release is not None:
                # Admitted, stale or refused: the worker is done with the version either way.
                await self.leases.release(release, scripts, ends_hold=False)
        self.pacer.submitted(submission.task_id, submission.worker_id)
        return result
