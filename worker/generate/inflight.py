"""In-flight updates: a generate task's sequences moved onto a newer version between two decode steps
(``async.inflight_versions = "follow"``).

A task holds the worker's backend lock while it samples, so the prefetcher, which loads each new version under
that lock, would wait for the task to end. Instead it downloads and verifies the version outside the lock as
before, offers the verified folder here (``VersionOffers.offer``), and only then waits for the lock. A task that
follows new versions asks between two decode steps (``Follower.newer``): it takes the offer, puts it in the
adapter cache and loads it into the backend on its own thread (the lock is already its own), and the backend
continues every unfinished sequence under it. When the prefetcher gets the lock it withdraws its offer; one the
task took is already loaded, so it loads nothing again.

Nothing here decides staleness: each token records the version that sampled it, and the rollout's oldest
token is what the proxy and the trainer check (``worker.algo.rollout``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from worker.generate.adapter_cache import AdapterCache
from worker.generate.backend import GenerationBackend

log = structlog.get_logger()


@dataclass(frozen=True)
class StagedVersion:
    """A version the prefetcher downloaded and verified against its manifest, not yet in the cache."""

    run: str
    version: int
    manifest_sha256: str
    path: Path


class VersionOffers:
    """The newest staged version of each run, from the prefetcher's thread to a sampling task's; and the newest
    version the prefetcher heard the proxy publish, before it downloads it (``published``). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offers: dict[str, StagedVersion] = {}
        self._published: dict[str, int] = {}

    def heard(self, run: str, version: int) -> None:
        """The proxy answered ``version`` as ``run``'s current one (versions only go up)."""
        with self._lock:
            self._published[run] = max(version, self._published.get(run, -1))

    def published(self, run: str) -> int | None:
        """The newest version heard of for ``run`` (None: none yet). A task whose oldest token it left more than
        ``max_staleness`` behind is refused (``worker.generate.partial.TaskCheckpoints``)."""
        with self._lock:
            return self._published.get(run)

    def offer(self, staged: StagedVersion) -> None:
        """Offer ``staged`` (replacing an older offer of its run: a task follows the newest only)."""
        with self._lock:
            current = self._offers.get(staged.run)
            if current is None or current.version < staged.version:
                self._offers[staged.run] = staged

    def offered(self, run: str) -> int | None:
        """The version on offer for ``run`` (None: none), for figures and tests."""
        with self._lock:
            staged = self._offers.get(run)
            return staged.version if staged is not None else None

    def take(self, run: str, newer_than: int) -> StagedVersion | None:
        """The run's offer if it is newer than ``newer_than``, taken (no one else loads it from its folder)."""
        with self._lock:
            staged = self._offers.get(run)
            if staged is None or staged.version <= newer_than:
                return None
            del self._offers[run]
            return staged

    def withdraw(self, staged: StagedVersion) -> bool:
        """Withdraw ``staged``; False when a task took it (and so loaded it) first."""
        with self._lock:
            if self._offers.get(staged.run) != staged:
                return False
            del self._offers[staged.run]
            return True


class Follower:
    """A task's ``VersionSource`` (``worker.generate.backend``): the newest version this worker holds for the run,
    the prefetcher's offer put in the cache and loaded first. Called on the sampling thread, lock held."""

    def __init__(
        self, run: str, cache: AdapterCache, backend: GenerationBackend, offers: VersionOffers | None = None
    ) -> None:
        self.run = run
        self.cache = cache
        self.backend = backend
        self.offers = offers
        self.switches = 0
        """Versions this task moved onto (for its figures)."""
        self._scanned = False  # the cache was looked through: while the task holds the lock only offers add to it

    def newer(self, version: int) -> tuple[str, int] | None:
        staged = self.offers.take(self.run, version) if self.offers is not None else None
        if staged is None and self._scanned:
            return None  # asked at every decode step: nothing new unless an offer came
        self._scanned = True
        if staged is not None:
            try:
                path = self.cache.get(staged.version, staged.manifest_sha256, staged=staged.path)
                self.backend.load_adapter(bucket_keys.adapter_name(staged.version), staged.version, path)
            except Exception as error:  # the task goes on with the version it has; the task path loads it later
                log.warning("generate.follow_load_failed", run=self.run, version=staged.version, error=str(error))
        loaded = set(self.backend.loaded_adapters())
        newest = max(
            (v for v in self.cache.versions() if v > version and bucket_keys.adapter_name(v) in loaded), default=None
        )
        if newest is None:
            return None
        self.switches += 1
        log.info("generate.version_followed", run=self.run, version=version, newer=newest)
        return bucket_keys.adapter_name(newest), newest
