"""The adapter cache (``AdapterCache``): the worker's local LRU cache of verified versions (at most
``max_staleness + 2``).

Why that size: a worker may still be asked for any version inside the staleness window (``max_staleness +
1`` versions) while the next one is being published, so one more slot lets the new version load before the
oldest is dropped. Every file is checked against its manifest's sha256 before it lands in the cache
(``asyncgrpo.bucket.layout.fetch_version``), so a corrupted or half-written upload is never served.
"""

from __future__ import annotations

import shutil
import time
from collections import OrderedDict
from pathlib import Path

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.bucket.layout import fetch_version
from worker.generate.backend import GenerationBackend

log = structlog.get_logger()


class AdapterCache:
    def __init__(
        self,
        bucket: Bucket,
        run: str,
        root: Path,
        capacity: int,
        backend: GenerationBackend | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"adapter cache capacity must be >= 1, got {capacity}")
        self.bucket = bucket
        self.run = run
        self.root = root / bucket_keys.check_run_name(run) / "adapters"
        self.capacity = capacity
        self.backend = backend
        """Told to drop a version evicted from the cache (None: the cache alone)."""
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
        if self.backend is not None:
            self.backend.drop_adapter(bucket_keys.adapter_name(version))
        shutil.rmtree(path, ignore_errors=True)
