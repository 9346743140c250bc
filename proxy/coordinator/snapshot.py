"""Snapshot of a run's coordinator state in the bucket: the document, its writer and its reader.

``runs/<run>/proxy/snapshot.json`` holds what is needed to go on (invariant 6): the current version and the
manifest sha256 of each published version, the prompt order position, the requeue line, every admitted and
not yet trained rollout with its groups, the step in flight, the generate tasks in flight, live leases,
the rollout retention queue, all counters and what each experiment tracker was sent (``tracking``: per tracker
the last step and the sorted versions of the evals sent; absent from older snapshots, which load as before).
The coordinator writes it after every change that matters, always before it tells a worker that a rollout was
admitted and before it sends any task (so a rebuilt proxy never hands out work twice under one name); tracker
progress only marks a change, which the next housekeeping tick writes. ``proxy.coordinator.rebuild`` reads
it back into an empty Redis.

Writes are group commits (``SnapshotWriter``): every change that arrives while a put is running is made
durable by the next one, so the bucket's put latency bounds each answer's wait, not the submit rate.

Fencing (``proxy.coordinator.leadership``): the document records the writing proxy's epoch
(``proxy_epoch``). A put happens only right after the proxy confirmed its lease in Redis, and never over a
snapshot of a higher epoch (read back at a new epoch and every ``READ_BACK_S``). The document ends with
``"sha256"``, the sha256 of every byte before that field; the reader verifies it and refuses a mismatch with
an error naming the key.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable
from typing import Any

from asyncgrpo.bucket import keys as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError, ObjectNotFound
from proxy.coordinator.errors import SnapshotFailed, StateMissing
from proxy.coordinator.leadership import FenceLost, Leader, ProxyFence
from proxy.coordinator.redis_store import RedisStore

SNAPSHOT_FORMAT = 2
LEGACY_FORMATS = (1,)
READ_BACK_S = 5.0
"""Seconds between two checks that no proxy of a higher epoch wrote the snapshot (``_fenced_epoch``)."""
"""Formats still read (written before the checksum and the epoch); the next write upgrades them."""
_CHECKSUM_FIELD = b',"sha256":"'
_HEADER = re.compile(rb'\{"format": ?(\d+), ?"run": ?"[^"\\]*", ?"proxy_epoch": ?(\d+)')


class SnapshotCorrupt(Exception):
    """The snapshot in the bucket cannot be read; the message names the key and what to do."""


def read_state_json(store: RedisStore) -> bytes | None:
    """The run's state, read atomically from Redis, as the snapshot document's JSON; None if Redis has none.

    Redis makes the JSON (``lua/snapshot_json.lua``): the proxy neither parses the whole state nor encodes it
    again at every write, which is most of a write's cost once the buffer holds hundreds of tasks.
    """
    return _read_state_json(store, 0)


def _read_state_json(store: RedisStore, epoch: int) -> bytes | None:
    header = json.dumps(
        {"format": SNAPSHOT_FORMAT, "run": store.run, "proxy_epoch": epoch, "written_at_ms": store.clock_ms()}
    )
    try:
        reply = store.scripts.snapshot_json(header_json=header)
    except StateMissing:
        return None
    document: str = reply["document"]
    return seal(document.encode())


def seal(document: bytes) -> bytes:
    """The document with its checksum field appended (the sha256 of every byte before the field)."""
    if not document.endswith(b"}"):
        raise ValueError("a snapshot document is a JSON object")
    body = document[:-1]
    return body + _CHECKSUM_FIELD + hashlib.sha256(body).hexdigest().encode() + b'"}'


def _verify(key: str, data: bytes) -> None:
    at = data.rfind(_CHECKSUM_FIELD)
    start = at + len(_CHECKSUM_FIELD)
    if at < 0 or data[start + 64 :].rstrip() != b'"}':
        raise SnapshotCorrupt(
            f"{key} has no sha256 checksum at its end (truncated or edited); restore it from a backup, or delete "
            "it to restart the run's prompt order from the latest complete version"
        )
    expected, actual = data[start : start + 64].decode(errors="replace"), hashlib.sha256(data[:at]).hexdigest()
    if expected != actual:
        raise SnapshotCorrupt(
            f"{key} fails its checksum (its sha256 field says {expected}, its bytes hash to {actual}): it was "
            "corrupted or edited; restore it from a backup, or delete it to restart the run's prompt order from "
            "the latest complete version"
        )


def snapshot_epoch(data: bytes) -> int:
    """The fencing epoch recorded in a snapshot's bytes (0 for a legacy one), read from its header only."""
    match = _HEADER.match(data)
    if match is not None:
        return int(match.group(2))
    try:
        return int(json.loads(data).get("proxy_epoch", 0))
    except (ValueError, AttributeError):
        return 0


def read_state_document(store: RedisStore) -> dict[str, Any] | None:
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
    if document.get("format") not in (SNAPSHOT_FORMAT, *LEGACY_FORMATS) or document.get("run") != run:
        raise SnapshotCorrupt(
            f"{key} has format {document.get('format')!r} for run {document.get('run')!r}; this proxy reads "
            f"format {SNAPSHOT_FORMAT} of run {run!r}"
        )
    if document["format"] not in LEGACY_FORMATS:  # a legacy document has no checksum; every later one has
        _verify(key, data)
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

    def __init__(
        self,
        store: RedisStore,
        bucket: Bucket,
        on_put: Callable[[], object] = lambda: None,
        fence: ProxyFence | None = None,
    ) -> None:
        self.store = store
        self.bucket = bucket
        self.fence = fence  # None: unfenced (tests of one coordinator); the server always passes one
        self.on_put = on_put  # counts the puts (the proxy's asyncgrpo_snapshot_writes_total)
        self._cond = threading.Condition()
        self._durable = -1  # highest change number a finished write covers
        self._running: _Write | None = None
        self.writes = 0
        """Snapshot puts attempted by this writer (benchmarks and tests compare it with submits)."""
        self._read_back: tuple[int, int] | None = None  # (epoch, clock ms) of the last bucket read-back

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
        key = bucket_keys.proxy_snapshot_key(self.store.run)
        try:
            epoch = 0 if self.fence is None else self._fenced_epoch(key)
            data = _read_state_json(self.store, epoch)
            if data is None:
                return False
            if self.fence is not None:
                self.fence.confirm()  # atomically in Redis, as close to the put as it gets
            self.bucket.put(key, data)
        except (BucketError, OSError) as error:
            raise SnapshotFailed(f"could not write the proxy snapshot of run {self.store.run!r}: {error}") from error
        return True

    def _fenced_epoch(self, key: str) -> int:
        """This proxy's epoch, once sure that no proxy of a higher epoch wrote the snapshot in the bucket."""
        assert self.fence is not None
        epoch = self.fence.confirm()
        # The Redis lease fences proxies sharing one Redis; the read-back catches one writing through another
        # Redis (a misconfiguration). That is detection, not prevention, so it runs once per epoch and then
        # every READ_BACK_S, not before every put of a group commit (it was one more GET per admission).
        last = self._read_back
        now = self.store.clock_ms()
        if last is not None and last[0] == epoch and now - last[1] < READ_BACK_S * 1000:
            return epoch
        self._read_back = (epoch, now)
        try:
            theirs = snapshot_epoch(self.bucket.get(key))
        except ObjectNotFound:
            return epoch
        self.fence.raise_floor(theirs)
        if theirs > epoch:
            self.fence.lost = self.fence.lost or Leader("?", theirs, "unknown (seen in the bucket)", 0, 0)
            raise FenceLost(
                f"{key} was written by a proxy of epoch {theirs}, above this proxy's {epoch}: another proxy "
                f"coordinates run {self.store.run!r} (check ASYNCGRPO_REDIS_URL: both must share one Redis); "
                "this one stops coordinating"
            )
        return epoch
