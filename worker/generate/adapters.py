"""A generate worker's adapters: the local LRU cache of verified versions (at most ``max_staleness + 2``),
and the prefetcher that loads each new version as soon as it is published.

The cache:

Why that size: a worker may still be asked for any version inside the staleness window (``max_staleness +
1`` versions) while the next one is being published, so one more slot lets the new version load before the
oldest is dropped. Every file is checked against its manifest's sha256 before it lands in the cache
(``asyncgrpo.bucket.layout.fetch_version``), so a corrupted or half-written upload is never served.

Load each new adapter version as soon as it is published, from a background thread of a generate worker.

Without it a worker fetches and loads a version only when its next task leases it, and every task pays
that on its critical path. The prefetcher long-polls the proxy (``GET /v1/versions/latest``); on a new
version it downloads the files and checks them against the manifest (outside any lock, so a running task
keeps generating), then, holding the worker's backend lock (the one a generate task holds while it loads
and samples; backends are not thread-safe), puts the version in the ``AdapterCache`` and loads it into the
backend. A task that leases that version then finds it cached and loaded.

Capacity: the cache keeps ``max_staleness + 2`` versions and evicts the least recently used one; since a
task holds the lock for as long as it uses its adapter, a preload can never evict a version in use.

Failures (proxy unreachable, bucket errors, an object that fails its sha256) are logged and retried with
backoff; a version that fails ``max_attempts`` times is left to the task path, which refuses a corrupt
object as before. Nothing here can stop the worker or a task.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import httpx
import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.bucket.layout import fetch_version
from asyncgrpo.protocol.client import ProxyClient, ProxyError
from asyncgrpo.protocol.schemas import LatestVersion
from worker.generate.backend import GenerationBackend

log = structlog.get_logger()


class AdapterCache:
    def __init__(
        self,
        bucket: Bucket,
        run: str,
        root: Path,
        capacity: int,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"adapter cache capacity must be >= 1, got {capacity}")
        self.bucket = bucket
        self.run = run
        self.root = root / bucket_keys.check_run_name(run) / "adapters"
        self.capacity = capacity
        self.on_evict = on_evict
        self._entries: OrderedDict[int, tuple[Path, str]] = OrderedDict()
        self.last_fetch_s = 0.0

    def versions(self) -> list[int]:
        return list(self._entries)

    def get(self, version: int, manifest_sha256: str, staged: Path | None = None) -> Path:
        """The local folder of ``version``; downloads and verifies it on a miss.

        ``staged``: a folder the caller already fetched and verified against ``manifest_sha256`` with
        ``fetch_version`` (the prefetcher, outside the worker's lock); on a miss it is moved in instead of
        downloading again. Not thread-safe: callers hold the worker's backend lock."""
        entry = self._entries.get(version)
        if entry is not None and entry[1] == manifest_sha256:
            self._entries.move_to_end(version)
            self.last_fetch_s = 0.0
            return entry[0]
        if entry is not None:
            # Same number, other manifest: never serve it (a version is immutable once published).
            self._evict(version)
        started = time.perf_counter()
        path = self.root / bucket_keys.adapter_name(version)
        if path.exists():
            shutil.rmtree(path)
        if staged is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            staged.rename(path)
        else:
            fetch_version(
                self.bucket,
                self.run,
                version,
                path,
                expected_manifest_sha256=manifest_sha256,
                names=bucket_keys.ADAPTER_FILE_NAMES,  # the trainer state is the trainer's: never downloaded here
            )
        self.last_fetch_s = time.perf_counter() - started
        seconds = round(self.last_fetch_s, 4)
        log.info("generate.adapter_fetched", version=version, seconds=seconds, staged=staged is not None)
        self._entries[version] = (path, manifest_sha256)
        while len(self._entries) > self.capacity:
            oldest = next(iter(self._entries))
            self._evict(oldest)
        return path

    def _evict(self, version: int) -> None:
        path, _ = self._entries.pop(version)
        if self.on_evict is not None:
            self.on_evict(version)
        shutil.rmtree(path, ignore_errors=True)


# ---- prefetch: each new version loaded as soon as it is published ----


Prepare = Callable[[str], tuple[AdapterCache, GenerationBackend]]
"""Given a run name, the worker's adapter cache and backend for it (built on first use); called under the lock."""


class AdapterPrefetcher:
    """A daemon thread: long poll, stage, then load under ``lock``. ``start()``/``stop()`` like the heartbeat."""

    def __init__(
        self,
        client: ProxyClient,
        bucket: Bucket,
        staging_root: Path,
        prepare: Prepare,
        lock: threading.RLock,
        *,
        wait_s: float = 20.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        max_attempts: int = 3,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.staging_root = staging_root
        self.prepare = prepare
        self.lock = lock
        self.wait_s = wait_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_attempts = max_attempts
        self.loaded_version: int | None = None
        """The newest version this thread loaded (for heartbeats and tests)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="asyncgrpo-prefetch", daemon=True)

    def start(self) -> None:
        # Leftovers of a process killed mid-download (its finally never ran); the folder is this worker's own.
        shutil.rmtree(self.staging_root, ignore_errors=True)
        self._thread.start()

    def stop(self, timeout_s: float = 0.0) -> None:
        """Stop after the current poll (at most ``wait_s``); waits ``timeout_s`` for the thread to end."""
        self._stop.set()
        if timeout_s > 0 and self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def close(self, timeout_s: float = 30.0) -> bool:
        """At process exit: stop, wait for a load in progress, and keep the lock so that none starts.

        A daemon thread inside a torch op when the interpreter finalizes aborts the process ("terminate
        called without an active exception"), so the exit path takes the lock and never gives it back.
        False if a load still held it after ``timeout_s``."""
        self._stop.set()
        return self.lock.acquire(timeout=timeout_s)

    def _loop(self) -> None:
        after = -1  # the newest version handled (loaded, or given up on)
        failures = 0  # consecutive failures, for the backoff
        attempts = 0  # failed attempts on the version in hand
        while not self._stop.is_set():
            try:
                latest = self.client.latest_version(after=after, wait_s=self.wait_s)
            except Exception as error:  # proxy down or restarting, a bad answer: poll again later
                failures += 1
                level = log.warning if isinstance(error, (ProxyError, httpx.HTTPError)) else log.exception
                level("generate.prefetch_poll_failed", error=str(error), failures=failures)
                self._stop.wait(self._delay(failures))
                continue
            if latest.version <= after or latest.manifest_sha256 is None or self._stop.is_set():
                failures = 0
                continue  # the wait ran out with nothing new (or no version yet): poll again
            try:
                self.load(latest)
            except Exception as error:  # any failure is logged and retried; the task path still works
                failures += 1
                attempts += 1
                gave_up = attempts >= self.max_attempts
                log.error(
                    "generate.prefetch_failed",
                    version=latest.version,
                    error=str(error),
                    error_kind=type(error).__name__,
                    attempt=attempts,
                    gave_up=gave_up,
                )
                if gave_up:  # left to the task path, which refuses it the same way if it is broken
                    after, attempts = latest.version, 0
                self._stop.wait(self._delay(failures))
                continue
            after, failures, attempts = latest.version, 0, 0

    def _delay(self, failures: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, failures - 1))

    def load(self, latest: LatestVersion) -> None:
        """Download and verify ``latest``, then cache and load it under the lock (raises on any failure)."""
        assert latest.manifest_sha256 is not None
        version = latest.version
        started = time.perf_counter()
        # Verified outside the lock: a task may be sampling meanwhile. fetch_version leaves nothing on a mismatch.
        staged = self.staging_root / f"{bucket_keys.adapter_name(version)}-{uuid.uuid4().hex}"
        try:
            fetch_version(
                self.bucket,
                latest.run,
                version,
                staged,
                expected_manifest_sha256=latest.manifest_sha256,
                names=bucket_keys.ADAPTER_FILE_NAMES,
            )
            fetched = time.perf_counter()
            with self.lock:
                if self._stop.is_set():  # the process is exiting (see close)
                    return
                locked = time.perf_counter()
                cache, backend = self.prepare(latest.run)
                path = cache.get(version, latest.manifest_sha256, staged=staged)
                backend.load_adapter(bucket_keys.adapter_name(version), version, path)
                loaded = time.perf_counter()
                # Wall clock, for measuring publish -> loaded across processes (benchmarks/bench_adapter_sync.py).
                loaded_at = time.time()
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        self.loaded_version = version
        log.info(
            "generate.adapter_prefetched",
            run=latest.run,
            version=version,
            fetch_s=round(fetched - started, 4),
            lock_wait_s=round(locked - fetched, 4),
            load_s=round(loaded - locked, 4),
            loaded_at=loaded_at,
        )
