"""Snapshot of a run's coordinator state in the bucket: the document, its writer and its reader.

``runs/<run>/proxy/snapshot.json`` holds what is needed to go on (invariant 6): the current version and the
manifest sha256 of each published version, the prompt order position, the requeue line, every admitted and
not yet trained rollout with its groups, the step in flight, the generate tasks in flight, live leases,
the rollout retention queue and all counters. The coordinator writes it after every change that matters,
always before it tells a worker that a rollout was admitted and before it sends any task (so a rebuilt proxy
never hands out work twice under one name). ``proxy.coordinator.rebuild`` reads it back into an empty Redis.

Writes are group commits (``SnapshotWriter``): every change that arrives while a put is running is made
durable by the next one, so the bucket's put latency bounds each answer's wait, not the submit rate.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from proxy.coordinator.errors import SnapshotFailed, StateMissing
from proxy.coordinator.store import RunStore
from proxy.storage import bucket_keys
from proxy.storage.bucket import Bucket, BucketError, ObjectNotFound

SNAPSHOT_FORMAT = 1


class SnapshotCorrupt(Exception):
    """The snapshot in the bucket cannot be read; the message names the key and what to do."""


def read_state_json(store: RunStore) -> bytes | None:
    """The run's state, read atomically from Redis, as the snapshot document's JSON; None if Redis has none.

    Redis makes the JSON (``lua/snapshot_json.lua``): the proxy neither parses the whole state nor encodes it
    again at every write, which is most of a write's cost once the buffer holds hundreds of tasks.
    """
    header = json.dumps({"format": SNAPSHOT_FORMAT, "run": store.run, "written_at_ms": store.clock_ms()})
    try:
        reply = store.scripts.snapshot_json(header_json=header)
    except StateMissing:
        return None
    document: str = reply["document"]
    return document.encode()


def read_state_document(store: RunStore) -> dict[str, Any] | None:
    """The run's state as the snapshot document (a dict); None if Redis has none."""
    data = read_state_json(store)
    return None if data is None else json.loads(data)


def load_snapshot(bucket: Bucket, run: str) -> dict[str, Any] | None:
    """The run's snapshot document from the bucket; None if there is none."""
    key = bucket_keys.proxy_snapshot_key(run)
    try:
        data = bucket.get(key)
    except ObjectNotFound:
        return None
    try:
        document = json.loads(data)
    except json.JSONDecodeError as error:
        raise SnapshotCorrupt(
            f"{key} is not valid JSON ({error}); restore it from a backup, or delete it to restart the run's "
            "prompt order from the latest complete version"
        ) from error
    if document.get("format") != SNAPSHOT_FORMAT or document.get("run") != run:
        raise SnapshotCorrupt(
            f"{key} has format {document.get('format')!r} for run {document.get('run')!r}; this proxy reads "
            f"format {SNAPSHOT_FORMAT} of run {run!r}"
        )
    return document


class _Write:
    """One bucket put of the snapshot: the change number it covers, and how it ended."""

    __slots__ = ("covers", "done", "error")

    def __init__(self, covers: int) -> None:
        self.covers = covers
        self.done = False
        self.error: SnapshotFailed | None = None


class SnapshotWriter:
    """Writes the snapshot with group commit: one put makes every change marked before it durable.

    A caller that needs its change durable (an admitted rollout, a publish, a dispatch) asks ``write()``
    after ``store.mark_changed()``. If a write that read the change counter at or after that change is
    running, the caller waits for it; otherwise it waits for the running one to end, and then one waiter
    becomes the writer for every change pending. The writer reads the counter BEFORE it reads the document,
    so the document holds every change counted up to there. A failed write fails every caller it covers
    (``SnapshotFailed``), so nobody is told "admitted" for a change that is not in the bucket. The snapshot
    rate therefore no longer bounds the submit rate: all submits arriving during one put share the next.
    """

    def __init__(self, store: RunStore, bucket: Bucket, on_put: Callable[[], object] = lambda: None) -> None:
        self.store = store
        self.bucket = bucket
        self.on_put = on_put  # counts the puts (the proxy's asyncgrpo_snapshot_writes_total)
        self._cond = threading.Condition()
        self._durable = -1  # highest change number a finished write covers
        self._running: _Write | None = None
        self.writes = 0
        """Snapshot puts attempted by this writer (benchmarks and tests compare it with submits)."""

    def write(self, *, force: bool = False) -> bool:
        """Make every change marked so far durable in ``runs/<run>/proxy/snapshot.json``; True if this call
        put it itself. ``force`` writes even if nothing changed. Raises ``SnapshotFailed`` if the put that
        covers the caller's changes failed."""
        if force:
            self.store.mark_changed()
        return self.write_through(self.store.changes)

    def write_through(self, target: int) -> bool:
        """Return once change number ``target`` is durable (see the class doc); True if this call wrote."""
        with self._cond:
            while True:
                running = self._running
                if running is None:
                    if self._durable >= target:
                        return False
                    # Become the writer for everything pending; the counter is read before the document.
                    mine = _Write(self.store.changes)
                    self._running = mine
                    self.writes += 1
                    self.on_put()
                    break
                if running.covers >= target:
                    while not running.done:
                        self._cond.wait()
                    if running.error is not None:
                        raise running.error
                    return False
                # The running write read the counter before our change: wait for it, then write anew.
                while not running.done:
                    self._cond.wait()
        written = False
        try:
            written = self._put()
        except SnapshotFailed as error:
            mine.error = error
            raise
        except Exception as error:  # Redis down while reading: the callers it covers are not durable either
            mine.error = SnapshotFailed(f"could not read the proxy snapshot of run {self.store.run!r}: {error}")
            raise
        finally:
            with self._cond:
                if written:
                    self._durable = max(self._durable, mine.covers)
                mine.done = True
                self._running = None
                self._cond.notify_all()
        return written

    def _put(self) -> bool:
        """Read the document from Redis and put it; False if Redis holds no state (nothing to write)."""
        data = read_state_json(self.store)
        if data is None:
            return False
        try:
            self.bucket.put(bucket_keys.proxy_snapshot_key(self.store.run), data)
        except (BucketError, OSError) as error:
            raise SnapshotFailed(f"could not write the proxy snapshot of run {self.store.run!r}: {error}") from error
        return True
