"""The snapshot: a run's coordinator state in the bucket (the document, its writer and its reader), and the
leadership that lets exactly one proxy write it.

``runs/<run>/proxy/snapshot.json`` holds what is needed to go on (invariant 6): the current version and the
manifest sha256 of each published version, the prompt order position, the requeue line, every admitted and
not yet trained rollout with its groups, the step in flight, the generate tasks in flight, live leases,
the rollout retention queue, all counters and what each experiment tracker was sent (``tracking``: per tracker
the last step and the sorted versions of the evals sent; absent from older snapshots, which load as before).
The coordinator writes it after every change that matters, always before it tells a worker that a rollout was
admitted and before it sends any task (so a rebuilt proxy never hands out work twice under one name); tracker
progress only marks a change, which the next housekeeping tick writes. ``restore_state`` reads it
back into an empty Redis (``proxy.coordinator.rebuild``).

Writes are group commits (``SnapshotWriter``): every change that arrives while a put is running is made
durable by the next one, so the bucket's put latency bounds each answer's wait, not the submit rate.

Fencing: the document records the writing proxy's epoch
(``proxy_epoch``). A put happens only right after the proxy confirmed its lease in Redis, and only over the
snapshot this writer last wrote or read (``If-Match`` on its ETag; ``If-None-Match: *`` where there was none).
So a proxy paused between its confirm and its put (past its lease) can never write once its successor has, and
a writer whose put is refused reads the snapshot back: a higher epoch there fences it. The document ends with
``"sha256"``, the sha256 of every byte before that field; the reader verifies it and refuses a mismatch with
an error naming the key.

Leadership (``ProxyFence``): one live proxy per run, a lease in Redis that carries a fencing epoch (invariant 6).

Leadership is the proxy's own lease, never to be mixed up with the version leases of generate workers.

The lease is one key per run (``RunKeys.proxy_lease``), set with a TTL of a few seconds and renewed by the
proxy's loop well within it. Its value names the holder (host, pid, since when) and the fencing **epoch**: a
Redis ``INCR`` counter, never below the epoch of the snapshot in the bucket (an emptied Redis does not reset
it). A second proxy finds the lease held and refuses to start (or, stand-by, waits until it lapses); a proxy
that finds its lease taken by another stops coordinating (``lost``). A proxy whose lease simply vanished (Redis
flushed, or the key expired while nobody else took it) takes it again with a new, higher epoch and goes on.

Every snapshot put is preceded by ``confirm()``: the lease is checked (and renewed) atomically in Redis right
before the put, and the snapshot records the epoch, so a proxy never regresses a newer proxy's snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError, ObjectChanged, ObjectNotFound
from proxy.coordinator.redis_store import RedisStore, RunKeys
from proxy.coordinator.scripts import CoordinatorError, SnapshotFailed, StateMissing

# ---- leadership: one live proxy per run, and its fencing epoch ----
log = structlog.get_logger()

DEFAULT_LEASE_TTL_S = 6.0

# KEYS[1] lease  KEYS[2] epoch counter
# ARGV[1] holder id  ARGV[2] holder JSON (host, pid, since_ms; no epoch)  ARGV[3] ttl ms  ARGV[4] floor epoch
# returns {"RENEWED", lease_json} (ours, TTL renewed) | {"ACQUIRED", lease_json} (was free: a new epoch, above
#   both the counter and the floor) | {"HELD", lease_json} (another holder; nothing changed)
ACQUIRE_LUA = """
local current = redis.call('GET', KEYS[1])
if current then
  local lease = cjson.decode(current)
  if lease['holder'] ~= ARGV[1] then return {'HELD', current} end
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'RENEWED', current}
end
local epoch = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[4])
if epoch <= floor then
  epoch = floor + 1
  redis.call('SET', KEYS[2], epoch)
end
local lease = cjson.decode(ARGV[2])
lease['holder'] = ARGV[1]
lease['epoch'] = epoch
local encoded = cjson.encode(lease)
redis.call('SET', KEYS[1], encoded, 'PX', ARGV[3])
return {'ACQUIRED', encoded}
"""

# KEYS[1] lease  ARGV[1] holder id
# returns 1 if the lease was ours and is now deleted, else 0
RELEASE_LUA = """
local current = redis.call('GET', KEYS[1])
if current and cjson.decode(current)['holder'] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class Leader:
    """Who holds a run's proxy lease, as stored in Redis."""

    holder: str
    epoch: int
    host: str
    pid: int
    since_ms: int

    @classmethod
    def parse(cls, encoded: str) -> Leader:
        raw: dict[str, Any] = json.loads(encoded)
        return cls(str(raw["holder"]), int(raw["epoch"]), str(raw["host"]), int(raw["pid"]), int(raw["since_ms"]))

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since_ms / 1000))
        return f"host {self.host} pid {self.pid} (epoch {self.epoch}, since {since})"


class LeadershipHeld(CoordinatorError):
    """Another live proxy holds the run's lease; ``holder`` says who."""

    def __init__(self, run: str, holder: Leader) -> None:
        super().__init__(
            f"run {run!r} is already coordinated by another proxy: {holder.describe()}. Stop that proxy first, "
            "or start this one as a stand-by (--standby or ASYNCGRPO_PROXY_STANDBY=1) to take over when its "
            "lease lapses"
        )
        self.holder = holder


class FenceLost(SnapshotFailed):
    """This proxy no longer holds the run's lease (another proxy took over); it must stop coordinating."""


class ProxyFence:
    """This proxy's lease on one run: acquire, renew (``confirm``), release; ``epoch`` is its fencing token.

    ``lost`` turns true (and stays true) once another holder is seen; every later ``confirm`` raises.
    """

    def __init__(self, redis: Redis, run: str, *, ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        self.redis = redis
        self.run = run
        self.keys = RunKeys(run)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.holder_id = uuid.uuid4().hex
        self._info = {"host": socket.gethostname(), "pid": os.getpid()}
        self._acquire = redis.register_script(ACQUIRE_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._lock = threading.Lock()
        self.epoch = 0
        """The epoch of the lease this proxy holds (0 before the first ``acquire``)."""
        self.floor = 0
        """The highest epoch known from elsewhere (the bucket's snapshot); a new epoch is always above it."""
        self.lost: Leader | None = None
        self.acquisitions = 0

    @property
    def renew_every_s(self) -> float:
        """How often the loop renews: a third of the TTL, so two renewals may fail before it lapses."""
        return self.ttl_ms / 3000

    def raise_floor(self, epoch: int) -> None:
        with self._lock:
            self.floor = max(self.floor, epoch)

    def holder(self) -> Leader | None:
        encoded = self.redis.get(self.keys.proxy_lease)
        return None if encoded is None else Leader.parse(encoded)

    def acquire(self) -> int:
        """Take or renew the lease; returns the epoch. Raises ``LeadershipHeld`` if another proxy holds it
        (and ``FenceLost`` if this proxy held it before: it was taken over)."""
        with self._lock:
            if self.lost is not None:
                raise FenceLost(self._lost_message(self.lost))
            info = json.dumps({**self._info, "since_ms": int(time.time() * 1000)})
            floor = max(self.floor, self.epoch)
            code, encoded = self._acquire(
                keys=[self.keys.proxy_lease, self.keys.proxy_epoch], args=[self.holder_id, info, self.ttl_ms, floor]
            )
            lease = Leader.parse(encoded)
            if code == "HELD":
                if self.epoch:
                    self.lost = lease
                    log.critical("proxy.lease_lost", run=self.run, epoch=self.epoch, taken_by=lease.describe())
                    raise FenceLost(self._lost_message(lease))
                raise LeadershipHeld(self.run, lease)
            if code == "ACQUIRED":
                self.acquisitions += 1
                log.warning("proxy.lease_acquired", run=self.run, epoch=lease.epoch, previous_epoch=self.epoch or None)
            self.epoch = lease.epoch
            return self.epoch

    def confirm(self) -> int:
        """Right before a state-changing write to the bucket: still ours (renewed or re-taken after a flush)?
        Returns the epoch; raises ``FenceLost`` if another proxy holds the lease."""
        try:
            return self.acquire()
        except LeadershipHeld as error:
            # Never held (acquire was skipped): treat as lost all the same; someone else coordinates the run.
            self.lost = error.holder
            raise FenceLost(self._lost_message(error.holder)) from error

    def release(self) -> bool:
        """Give the lease up (clean shutdown), so a stand-by takes over at once; True if it was ours."""
        if self.lost is not None:
            return False
        return bool(self._release(keys=[self.keys.proxy_lease], args=[self.holder_id]))

    def _lost_message(self, holder: Leader) -> str:
        return (
            f"this proxy (epoch {self.epoch}) lost the lease of run {self.run!r} to {holder.describe()}; it stops "
            "coordinating (restart it with --standby to wait for the lease)"
        )


# ----
SNAPSHOT_FORMAT = 2
LEGACY_FORMATS = (1,)
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
        self._seen = False  # whether _etag is known: read from the bucket, or this writer's last put
        self._etag: str | None = None  # the snapshot's ETag then (None: there was no snapshot)

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
        """Read the document from Redis and put it over the snapshot this writer last saw; False if Redis
        holds no state (nothing to write)."""
        key = bucket_keys.proxy_snapshot_key(self.store.run)
        try:
            epoch = 0 if self.fence is None else self.fence.confirm()
            if not self._seen:
                self._see(key, epoch)
            data = _read_state_json(self.store, epoch)
            if data is None:
                return False
            if self.fence is not None:
                self.fence.confirm()  # atomically in Redis, as close to the put as it gets
            try:
                self._etag = self.bucket.put_if_match(key, data, self._etag)
            except ObjectChanged:
                # Written by someone else since: a proxy of a higher epoch fences this one (FenceLost). A lower
                # or equal epoch is a late put of a deposed proxy (or of this one, its answer lost) that this
                # proxy's Redis state already holds, or an operator's edit: put over it, once.
                self._see(key, epoch)
                log.warning("proxy.snapshot_changed_underneath", run=self.store.run, epoch=epoch)
                self._etag = self.bucket.put_if_match(key, data, self._etag)
        except ObjectChanged as error:
            self._seen = False
            raise SnapshotFailed(
                f"the proxy snapshot of run {self.store.run!r} changed again while it was written: {error}"
            ) from error
        except (BucketError, OSError) as error:
            self._seen = False  # the put may have landed: read the ETag again before the next one
            raise SnapshotFailed(f"could not write the proxy snapshot of run {self.store.run!r}: {error}") from error
        return True

    def _see(self, key: str, epoch: int) -> None:
        """Read the snapshot's ETag (None: there is none), after checking that no proxy of a higher epoch wrote
        it (two proxies on two Redis: a wrong ASYNCGRPO_REDIS_URL)."""
        try:
            data, etag = self.bucket.get_tagged(key)
        except ObjectNotFound:
            self._seen, self._etag = True, None
            return
        theirs = snapshot_epoch(data)
        if self.fence is not None:
            self.fence.raise_floor(theirs)
            if theirs > epoch:
                self.fence.lost = self.fence.lost or Leader("?", theirs, "unknown (seen in the bucket)", 0, 0)
                raise FenceLost(
                    f"{key} was written by a proxy of epoch {theirs}, above this proxy's {epoch}: another proxy "
                    f"coordinates run {self.store.run!r} (check ASYNCGRPO_REDIS_URL: both must share one Redis); "
                    "this one stops coordinating"
                )
        self._seen, self._etag = True, etag
