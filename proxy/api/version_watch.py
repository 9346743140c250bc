"""``GET /v1/versions/latest``: a long poll that tells generate workers about a new version as it is published.

A worker asks ``?after=N&wait_s=S``. If the current version is newer than N the answer comes at once; else
the request waits, at most ``S`` seconds (<= ``MAX_WAIT_S``), and answers as soon as a version is published,
or with the unchanged current version when the time runs out. The answer names the version's manifest key
and sha256, as a lease does, so the worker can fetch and verify it before any task leases it.

Wake-ups: a publish through this process calls ``VersionWatch.notify()`` (from the request's thread), which
wakes every waiter at once. A publish this process did not see (another proxy process, a state rebuilt
while it was restarting) is caught by each waiter re-reading Redis every ``fallback_s`` seconds. On
shutdown ``close()`` answers every waiter at once, so open polls never hold up uvicorn's graceful exit.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Query

from asyncgrpo.bucket import keys as bucket_keys
from asyncgrpo.protocol.schemas import LatestVersion
from proxy.coordinator.service import Coordinator

if TYPE_CHECKING:
    import uvicorn

MAX_WAIT_S = 30.0
"""Longest wait a client may ask for: below the usual 60 s idle timeout of load balancers."""
FALLBACK_S = 1.0
"""How often a waiter re-reads Redis for a publish this process was not told about."""


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
        if self._loop is not loop:  # first waiter (or a new loop in tests): events belong to one loop
            self._loop, self._changed = loop, asyncio.Event()
        deadline = loop.time() + wait_s
        self.waiting += 1
        try:
            while True:
                # Taken before reading Redis, so a publish between the read and the wait still wakes us.
                changed = self._changed
                assert changed is not None
                latest = await asyncio.to_thread(self.latest)
                remaining = deadline - loop.time()
                if latest.version > after or remaining <= 0 or self._closing:
                    return latest
                with suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout=min(remaining, self.fallback_s))
        finally:
            self.waiting -= 1

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
        # Waiters hold the old event; a fresh one is for the next round.
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()


def install_version_watch(app: FastAPI, coordinator: Coordinator) -> VersionWatch:
    """Add ``GET /v1/versions/latest`` to ``app``; the caller calls ``notify()`` after each publish."""
    watch = VersionWatch(coordinator)
    app.state.version_watch = watch

    @app.get("/v1/versions/latest", response_model=LatestVersion)
    async def latest_version(
        after: Annotated[int, Query(ge=-1, description="The version the caller holds (-1: none).")] = -1,
        wait_s: Annotated[
            float, Query(ge=0.0, le=MAX_WAIT_S, description="Seconds to wait for a newer version (0: answer now).")
        ] = 0.0,
    ) -> LatestVersion:
        return await watch.wait_newer(after, wait_s)

    return watch


def releasing_server(config: uvicorn.Config, watch: VersionWatch) -> uvicorn.Server:
    """A uvicorn server that answers the open long polls as soon as it is told to stop."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            watch.close()
            super().handle_exit(sig, frame)

    return _Server(config)
