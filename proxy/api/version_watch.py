"""``GET /v1/versions/latest``: a long poll that tells generate workers about a new version as it is published.

A worker asks ``?after=N&wait_s=S``. If the current version is newer than N the answer comes at once; else
the request waits, at most ``S`` seconds (<= ``MAX_WAIT_S``), and answers as soon as a version is published,
or with the unchanged current version when the time runs out. The answer names the version's manifest key
and sha256, as a lease does, so the worker can fetch and verify it before any task leases it.

Wake-ups: a publish through this process calls ``VersionWatch.notify()`` (from the request's thread), which
wakes every waiter at once. A publish this process did not see (another proxy process, a state rebuilt
while it was restarting) is caught by one watcher task re-reading Redis every ``fallback_s`` seconds while
anyone waits, which wakes them all when the version moved. The waiters share their reads: one read of Redis per
``fallback_s`` and per publish serves every open poll, and a waiter wakes only for a publish or its deadline
(not at every re-read: at 1,000 waiters that was 1,000 timers a second), so a fleet of a thousand prefetchers
costs what one does. On shutdown ``close()`` answers every waiter at once, so open
polls never hold up uvicorn's graceful exit.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import TYPE_CHECKING, Annotated, Any

import structlog
from fastapi import FastAPI, Query
from starlette.responses import Response

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.protocol.schemas import LatestVersion
from proxy.api.edge import FleetRoute, answer, routes_of
from proxy.coordinator.service import Coordinator

if TYPE_CHECKING:
    import uvicorn

log = structlog.get_logger()

MAX_WAIT_S = 30.0
"""Longest wait a client may ask for: below the usual 60 s idle timeout of load balancers."""
FALLBACK_S = 1.0
"""How often the watcher re-reads Redis for a publish this process was not told about."""


class VersionWatch:
    """Waiters for a version newer than the one they hold; ``notify`` after every publish."""

    def __init__(self, coordinator: Coordinator, *, fallback_s: float = FALLBACK_S) -> None:
        self.coordinator = coordinator
        self.fallback_s = fallback_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._closing = False
        self.waiting = 0
        """Requests waiting right now (tests, debugging)."""
        self.reads = 0
        """Reads of Redis so far (tests, benchmarks): shared by the waiters."""
        self.sleeps = 0
        """Times a waiter went to sleep so far (tests): once per poll, and again only after a wake-up."""
        self._publishes = 0  # notify() calls so far: a read from before the last one is out of date
        self._read: tuple[LatestVersion, float, int] | None = None  # (answer, loop time, publishes) of the last
        self._reading: asyncio.Task[LatestVersion] | None = None
        self._watcher: asyncio.Task[None] | None = None

    def latest(self) -> LatestVersion:
        """The current version as Redis has it (blocking: two HGETs)."""
        coord = self.coordinator
        version = coord.current_version()
        sha = coord.redis.hget(coord.keys.versions, str(version)) if version >= 0 else None
        published = version >= 0
        return LatestVersion(
            run=coord.run,
            version=version,
            adapter_prefix=bucket_keys.adapter_prefix(coord.run, version) if published else None,
            manifest_key=bucket_keys.manifest_key(coord.run, version) if published else None,
            manifest_sha256=sha or None,
        )

    async def wait_newer(self, after: int, wait_s: float) -> LatestVersion:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first waiter (or a new loop in tests): events and tasks belong to one loop
            self._loop, self._changed = loop, asyncio.Event()
            self._read = self._reading = self._watcher = None
        deadline = loop.time() + wait_s
        self.waiting += 1
        try:
            while True:
                # Taken before reading Redis, so a publish between the read and the wait still wakes us.
                changed = self._changed
                assert changed is not None
                latest = await self._shared_latest()
                remaining = deadline - loop.time()
                if latest.version > after or remaining <= 0 or self._closing:
                    return latest
                if self._watcher is None or self._watcher.done():
                    self._watcher = loop.create_task(self._watch())
                self.sleeps += 1
                with suppress(TimeoutError):
                    async with asyncio.timeout(remaining):  # one timer per wait, no task (unlike wait_for)
                        await changed.wait()
        finally:
            self.waiting -= 1

    async def _watch(self) -> None:
        """While anyone waits: read Redis again every ``fallback_s`` (a read that finds the version moved wakes
        every waiter, ``_read_latest``)."""
        while self.waiting > 0 and not self._closing:
            await asyncio.sleep(self.fallback_s)
            try:
                await self._shared_latest()
            except Exception:  # Redis unreachable for a moment: the waiters' deadlines still answer them
                log.warning("proxy.version_watch_read_failed", exc_info=True)

    async def _shared_latest(self) -> LatestVersion:
        """The current version, read from Redis by one waiter for all: again only once ``fallback_s`` passed
        or a publish was notified since the last read (single flight: the waiters await one read)."""
        loop = asyncio.get_running_loop()
        last = self._read
        if last is not None and last[2] == self._publishes and loop.time() - last[1] < self.fallback_s:
            return last[0]
        if self._reading is None or self._reading.done():
            self._reading = loop.create_task(self._read_latest())
        # Shielded: a waiter whose client went away must not cancel the read the others wait for.
        return await asyncio.shield(self._reading)

    async def _read_latest(self) -> LatestVersion:
        publishes = self._publishes  # before the read: a publish during it makes it out of date at once
        self.reads += 1
        latest = await asyncio.to_thread(self.latest)
        moved = self._read is not None and self._read[0].version != latest.version
        self._read = (latest, asyncio.get_running_loop().time(), publishes)
        if moved:  # a publish this process was not told about: every waiter read an older version
            self._ring()
        return latest

    def notify(self) -> None:
        """A version was published: wake every waiter (safe from any thread)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)

    def close(self) -> None:
        """Answer every waiter now and every later one at once (the server is stopping)."""
        self._closing = True
        self.notify()

    def _wake(self) -> None:
        self._publishes += 1
        self._ring()

    def _ring(self) -> None:
        # Waiters hold the old event; a fresh one is for the next round.
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()


def install_version_watch(app: FastAPI, coordinator: Coordinator) -> VersionWatch:
    """Add ``GET /v1/versions/latest`` to ``app``; the caller calls ``notify()`` after each publish."""
    watch = VersionWatch(coordinator)
    app.state.version_watch = watch

    with routes_of(app, FleetRoute):  # a long poll from every generate worker: validated in one pass

        @app.get("/v1/versions/latest", response_model=LatestVersion)
        async def latest_version(
            after: Annotated[int, Query(ge=-1, description="The version the caller holds (-1: none).")] = -1,
            wait_s: Annotated[
                float, Query(ge=0.0, le=MAX_WAIT_S, description="Seconds to wait for a newer version (0: answer now).")
            ] = 0.0,
        ) -> Response:
            return answer(await watch.wait_newer(after, wait_s))

    return watch


def releasing_server(config: uvicorn.Config, watch: VersionWatch) -> uvicorn.Server:
    """A uvicorn server that answers the open long polls as soon as it is told to stop."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            watch.close()
            super().handle_exit(sig, frame)

    return _Server(config)
