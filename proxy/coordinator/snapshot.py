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
(``proxy_epoch``). A put happens only right after the proxy confirmed its leadership in Redis, and only over the
snapshot this writer last wrote or read (``If-Match`` on its ETag; ``If-None-Match: *`` where there was none).
So a proxy paused between its confirm and its put (past its leadership's TTL) can never write once its successor
has, and a writer whose put is refused reads the snapshot back: a higher epoch there fences it. The document ends with
``"sha256"``, the sha256 of every byte before that field; the reader verifies it and refuses a mismatch with
an error naming the key.

Leadership (``Leadership``): one live proxy per run, a key in Redis that carries a fencing epoch (invariant 6).
It is the proxy's own, never to be mixed up with the task leases and version leases of generate workers.

The leadership is one key per run (``RunKeys.proxy_leadership``; its Redis name is still ``proxy_lease``, which
running deployments hold), set with a TTL of a few seconds and renewed by the proxy's loop well within it. Its
value names the holder (host, pid, since when) and the fencing **epoch**: a Redis ``INCR`` counter, never below
the epoch of the snapshot in the bucket (an emptied Redis does not reset it). A second proxy finds the leadership
held and refuses to start (or, stand-by, waits until it lapses); a proxy that finds its leadership taken by
another stops coordinating (``lost``). A proxy whose leadership simply vanished (Redis flushed, or the key expired
while nobody else took it) takes it again with a new, higher epoch and goes on.

Every snapshot put is preceded by ``confirm()``: the leadership is checked (and renewed) atomically in Redis
right before the put, and the snapshot records the epoch, so a proxy never regresses a newer proxy's snapshot.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import structlog
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError, ObjectChanged, ObjectNotFound
from proxy.coordinator.redis_store import RedisStore, RunKeys
from proxy.coordinator.scripts import CoordinatorError, SnapshotFailed, StateMissing
from proxy.coordinator.snapshot_log import CompactionPolicy, Replay

# ---- leadership: one live proxy per run, and its fencing epoch ----
log = structlog.get_logger()

DEFAULT_LEADERSHIP_TTL_S = 6.0

# KEYS[1] leadership  KEYS[2] epoch counter
# ARGV[1] holder id  ARGV[2] holder JSON (host, pid, since_ms; no epoch)  ARGV[3] ttl ms  ARGV[4] floor epoch
# returns {"RENEWED", leader_json} (ours, TTL renewed) | {"ACQUIRED", leader_json} (was free: a new epoch, above
#   both the counter and the floor) | {"HELD", leader_json} (another holder; nothing changed)
ACQUIRE_LUA = """
local current = redis.call('GET', KEYS[1])
if current then
  local leader = cjson.decode(current)
  if leader['holder'] ~= ARGV[1] then return {'HELD', current} end
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'RENEWED', current}
end
local epoch = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[4])
if epoch <= floor then
  epoch = floor + 1
  redis.call('SET', KEYS[2], epoch)
end
local leader = cjson.decode(ARGV[2])
leader['holder'] = ARGV[1]
leader['epoch'] = epoch
local encoded = cjson.encode(leader)
redis.call('SET', KEYS[1], encoded, 'PX', ARGV[3])
return {'ACQUIRED', encoded}
"""

# KEYS[1] leadership  ARGV[1] holder id
# returns 1 if the leadership was ours and is now deleted, else 0
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
    """Who holds a run's leadership, as stored in Redis."""

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
    """Another live proxy holds the run's leadership; ``holder`` says who."""

    def __init__(self, run: str, holder: Leader) -> None:
        super().__init__(
            f"run {run!r} is already coordinated by another proxy: {holder.describe()}. Stop that proxy first, "
            "or start this one as a stand-by (--standby or ASYNCGRPO_PROXY_STANDBY=1) to take over when its "
            "leadership lapses"
        )
        self.holder = holder


class LeadershipLost(SnapshotFailed):
    """This proxy no longer holds the run's leadership (another proxy took over); it must stop coordinating."""


class Leadership:
    """This proxy's leadership of one run: acquire, renew (``confirm``), release; ``epoch`` is its fencing token.

    ``lost`` turns true (and stays true) once another holder is seen; every later ``confirm`` raises.
    """

    def __init__(self, redis: Redis, run: str, *, ttl_s: float = DEFAULT_LEADERSHIP_TTL_S) -> None:
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
        """The epoch of the leadership this proxy holds (0 before the first ``acquire``)."""
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
        encoded = self.redis.get(self.keys.proxy_leadership)
        return None if encoded is None else Leader.parse(encoded)

    def acquire(self) -> int:
        """Take or renew the leadership; returns the epoch. Raises ``LeadershipHeld`` if another proxy holds it
        (and ``LeadershipLost`` if this proxy held it before: it was taken over)."""
        with self._lock:
            if self.lost is not None:
                raise LeadershipLost(self._lost_message(self.lost))
            info = json.dumps({**self._info, "since_ms": int(time.time() * 1000)})
            floor = max(self.floor, self.epoch)
            code, encoded = self._acquire(
                keys=[self.keys.proxy_leadership, self.keys.proxy_epoch],
                args=[self.holder_id, info, self.ttl_ms, floor],
            )
            leader = Leader.parse(encoded)
            if code == "HELD":
                if self.epoch:
                    self.lost = leader
                    log.critical("proxy.leadership_lost", run=self.run, epoch=self.epoch, taken_by=leader.describe())
                    raise LeadershipLost(self._lost_message(leader))
                raise LeadershipHeld(self.run, leader)
            if code == "ACQUIRED":
                self.acquisitions += 1
                log.warning(
                    "proxy.leadership_acquired", run=self.run, epoch=leader.epoch, previous_epoch=self.epoch or None
                )
            self.epoch = leader.epoch
            return self.epoch

    def confirm(self) -> int:
        """Right before a state-changing write to the bucket: still ours (renewed or re-taken after a flush)?
        Returns the epoch; raises ``LeadershipLost`` if another proxy holds the leadership."""
        try:
            return self.acquire()
        except LeadershipHeld as error:
            # Never held (acquire was skipped): treat as lost all the same; someone else coordinates the run.
            self.lost = error.holder
            raise LeadershipLost(self._lost_message(error.holder)) from error

    def check_taken(self) -> None:
        """Raise ``LeadershipLost`` if another proxy holds the leadership now (a script found this epoch's gone)."""
        holder = self.holder()
        if holder is not None and holder.holder != self.holder_id:
            self.lost = self.lost or holder
            raise LeadershipLost(self._lost_message(holder))

    def release(self) -> bool:
        """Give the leadership up (clean shutdown), so a stand-by takes over at once; True if it was ours."""
        if self.lost is not None:
            return False
        return bool(self._release(keys=[self.keys.proxy_leadership], args=[self.holder_id]))

    def _lost_message(self, holder: Leader) -> str:
        return (
            f"this proxy (epoch {self.epoch}) lost the leadership of run {self.run!r} to {holder.describe()}; it stops "
            "coordinating (restart it with --standby to wait for the leadership)"
        )


# ----
SNAPSHOT_FORMAT = 3
LEGACY_FORMATS = (1, 2)
"""Formats still read (1: before the checksum and the epoch; 2: before the log, so no segment applies to it); the
next write upgrades them. Format 3 has ``log_through``, and segments of the same format follow it."""
_CHECKSUM_FIELD = b',"sha256":"'
_HEADER = re.compile(rb'\{"format": ?(\d+), ?"run": ?"[^"\\]*", ?"proxy_epoch": ?(\d+)')


LEADERSHIP_CHECK_S = 5.0
"""How often a writer putting segments reads the snapshot's ETag back: a proxy of a higher epoch on another Redis
(a wrong ASYNCGRPO_REDIS_URL) replaced it, and a rebuild would pass over this proxy's segments, so it must stop."""


class SnapshotCorrupt(Exception):
    """The snapshot in the bucket cannot be read; the message names the key and what to do."""


def read_state_json(store: RedisStore) -> bytes | None:
    """The run's state, read atomically from Redis, as the snapshot document's JSON; None if Redis has none.

    Redis makes the JSON (``lua/snapshot_json.lua``): the proxy neither parses the whole state nor encodes it
    again at every write, which is most of a write's cost once the buffer holds hundreds of tasks.
    """
    read = _read_state_json(store, 0, compact=False)
    return None if read is None else read[0]


def _read_state_json(store: RedisStore, epoch: int, *, compact: bool) -> tuple[bytes | None, int] | None:
    """The sealed document and the log number it covers (0 unless ``compact``: see ``snapshot_json.lua``); None
    if Redis holds no state; ``(None, epoch)`` where a compaction finds the leadership not held at ``epoch``."""
    header = json.dumps(
        {"format": SNAPSHOT_FORMAT, "run": store.run, "proxy_epoch": epoch, "written_at_ms": store.clock_ms()}
    )
    try:
        reply = store.scripts.snapshot_json(header_json=header, compact="1" if compact else "0", epoch=epoch)
    except StateMissing:
        return None
    if reply.code == "FENCED":
        return None, epoch
    document: str = reply["document"]
    return seal(document.encode()), reply["log_through"]


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


@dataclass(frozen=True)
class StoredState:
    """What the bucket holds of a run's coordinator state."""

    document: dict[str, Any] | None
    """The snapshot with the log after it applied (``proxy.coordinator.snapshot_log``); None without a snapshot."""
    last_seq: int
    """The highest log number in the bucket (0: none): a state rebuilt from it numbers its log above."""
    segments: int
    """How many segments were applied."""


def load_snapshot(bucket: Bucket, run: str) -> dict[str, Any] | None:
    """The run's state as the bucket holds it: the snapshot document with its log applied; None if there is no
    snapshot."""
    return load_stored_state(bucket, run).document


LOAD_ATTEMPTS = 5
"""Reads of the snapshot and its log a reader makes while a live proxy compacts under it (each compaction moves
the snapshot on and deletes the segments it covers)."""


class _CompactedMeanwhile(Exception):
    """A segment vanished, or a number is missing, and the snapshot moved on since it was read: read again."""


def load_stored_state(bucket: Bucket, run: str) -> StoredState:
    """The snapshot, the log segments above the number it covers applied in order, and the last log number.

    A segment of an older epoch than the snapshot's is a late put of a deposed proxy (its successor compacted
    first, so what it holds is in the snapshot): it is passed over. A missing number between two segments is a
    lost object, refused with ``SnapshotCorrupt`` naming it, unless the snapshot moved on meanwhile (a live
    proxy compacted): then it is read again."""
    for _ in range(LOAD_ATTEMPTS - 1):
        try:
            return _load_stored_state(bucket, run)
        except _CompactedMeanwhile:
            continue
    return _load_stored_state(bucket, run, last_attempt=True)


def _load_stored_state(bucket: Bucket, run: str, *, last_attempt: bool = False) -> StoredState:
    document = _load_snapshot_object(bucket, run)
    listed = sorted(
        seq for key in bucket.list(bucket_keys.proxy_log_prefix(run)) if (seq := bucket_keys.seq_from_log_key(key))
    )
    last = listed[-1] if listed else 0
    if document is None or "log_through" not in document:
        return StoredState(document, last, 0)  # no snapshot, or one from before the log: no segment applies
    through, epoch = int(document["log_through"]), int(document["proxy_epoch"])

    def moved_on() -> bool:
        now = _load_snapshot_object(bucket, run)
        return not last_attempt and now is not None and now.get("log_through") != through

    pending = [seq for seq in listed if seq > through]
    try:
        segments = _read_segments(bucket, run, pending)
    except ObjectNotFound:
        if moved_on():
            raise _CompactedMeanwhile from None
        raise
    replay = Replay(document)
    expected = through + 1
    for seq, segment in zip(pending, segments, strict=True):
        if int(segment["proxy_epoch"]) < epoch:
            log.warning("proxy.log_segment_passed_over", run=run, seq=seq, epoch=segment["proxy_epoch"], snapshot=epoch)
        elif seq != expected:
            if moved_on():
                raise _CompactedMeanwhile
            raise SnapshotCorrupt(
                f"{bucket_keys.proxy_log_key(run, expected)} is missing from the snapshot log of run {run!r} "
                f"(segment {seq} follows it): an object was lost from the bucket; restore it from a backup, or delete "
                f"the segments above {expected - 1} to go on from there, losing the changes they hold"
            )
        else:
            replay.apply(segment)
        expected = max(expected, seq + 1)
    return StoredState(replay.document(), last, replay.applied)


def _read_segments(bucket: Bucket, run: str, seqs: list[int]) -> list[dict[str, Any]]:
    """The segments ``seqs``, read in parallel, each checked (checksum, format, run, number)."""

    def read(seq: int) -> dict[str, Any]:
        key = bucket_keys.proxy_log_key(run, seq)
        data = bucket.get(key)
        _verify(key, data)
        segment: dict[str, Any] = json.loads(data)
        if segment.get("format") != SNAPSHOT_FORMAT or segment.get("run") != run or segment.get("seq") != seq:
            raise SnapshotCorrupt(
                f"{key} holds format {segment.get('format')!r}, run {segment.get('run')!r}, number "
                f"{segment.get('seq')!r}; this proxy reads format {SNAPSHOT_FORMAT} of run {run!r}"
            )
        return segment

    if not seqs:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(seqs))) as pool:
        return list(pool.map(read, seqs))


def _load_snapshot_object(bucket: Bucket, run: str) -> dict[str, Any] | None:
    """The snapshot document itself (no log applied); None if there is none."""
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


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # its caller went away
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class SnapshotWriter:
    """Writes the snapshot and its log with group commit: one put makes every change marked before it durable.

    A caller that needs its change durable (an admitted rollout, a publish, a dispatch) asks ``write()``
    after ``store.mark_changed()``. If a write that read the change counter at or after that change is
    running, the caller waits for it; otherwise it waits for the running one to end, and then one waiter
    becomes the writer for every change pending. The writer reads the counter BEFORE it reads Redis,
    so what it puts holds every change counted up to there. A failed write fails every caller it covers
    (``SnapshotFailed``), so nobody is told "admitted" for a change that is not in the bucket. The snapshot
    rate therefore no longer bounds the submit rate: all submits arriving during one put share the next.

    Each put is a log segment (what changed since the last put, ``proxy.coordinator.snapshot_log``) or, when
    ``policy`` says so, a compaction: the whole snapshot, after which the segments it covers are deleted. The
    first put of a writer is a compaction (so a new leader's first write covers everything, and any segment a
    deposed proxy puts late lies below it), and so is the put after a failed one (whose segment may or may not
    have landed).
    """

    def __init__(
        self,
        store: RedisStore,
        bucket: Bucket,
        on_put: Callable[[], object] = lambda: None,
        leadership: Leadership | None = None,
        policy: CompactionPolicy | None = None,
        on_written: Callable[[bool, int], object] = lambda compaction, size: None,
    ) -> None:
        self.store = store
        self.bucket = bucket
        self.leadership = leadership  # None: unfenced (tests of one coordinator); the server always passes one
        self.on_put = on_put  # counts the puts (the proxy's asyncgrpo_snapshot_writes_total)
        self.policy = policy or CompactionPolicy()
        self.on_written = on_written  # each put that landed: (a compaction?, its bytes), for the metrics
        self._cond = threading.Condition()
        self._durable = -1  # highest change number a finished write covers
        self._running: _Write | None = None
        self.writes = 0
        """Puts attempted by this writer, segments and compactions (benchmarks and tests compare it with submits)."""
        self.compactions = 0
        """Compactions put by this writer."""
        self.put_bytes = 0
        """Bytes this writer put, segments and compactions."""
        self._seen = False  # whether _etag is known: read from the bucket, or this writer's last put
        self._etag: str | None = None  # the snapshot's ETag then (None: there was no snapshot)
        self._must_compact = True  # the first put, and the put after a failed one
        self._segments = 0  # segments put since the last compaction
        self._log_bytes = 0  # their bytes
        self._snapshot_bytes = 0  # the last compaction's bytes
        self._collect_through = 0  # segments up to this number are covered by a compaction: delete them
        self.monotonic: Callable[[], float] = time.monotonic  # tests move it on
        self._checked_at = 0.0  # when the snapshot's ETag was last read or written
        self._epoch = -1  # the fencing epoch of this writer's last compaction
        # Callers on an event loop (``wait_durable``): (change number, their future, its loop), answered
        # by the write that covers them; a pump thread writes while any wait (no thread waits per caller).
        self._loop_waiters: list[tuple[int, asyncio.Future[None], asyncio.AbstractEventLoop]] = []
        self._pumping = False

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
            self._must_compact = True  # its segment may or may not have landed: the next put covers both cases
            mine.error = error
            raise
        except Exception as error:  # Redis down while reading: the callers it covers are not durable either
            self._must_compact = True
            mine.error = SnapshotFailed(f"could not read the proxy snapshot of run {self.store.run!r}: {error}")
            raise
        finally:
            with self._cond:
                if written:
                    self._durable = max(self._durable, mine.covers)
                mine.done = True
                self._running = None
                self._cond.notify_all()
                self._answer_loop_waiters(mine)
        self._collect_log()  # after the callers are answered: what a compaction covers is no longer needed
        return written

    async def wait_durable(self, target: int) -> None:
        """``write_through`` for a caller on an event loop: returns once change number ``target`` is durable,
        raises ``SnapshotFailed`` as it does. The puts run in one pump thread while anyone waits."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._durable >= target:
                return
            self._loop_waiters.append((target, future, loop))
            start, self._pumping = not self._pumping, True
        if start:
            threading.Thread(target=self._pump, name="snapshot-pump", daemon=True).start()
        await future

    def _pump(self) -> None:
        """Write until no caller on a loop waits (each put covers every one that waited before it read)."""
        while True:
            with self._cond:
                if not self._loop_waiters:
                    self._pumping = False
                    return
                target = max(target for target, _, _ in self._loop_waiters)
            try:
                self.write_through(target)
            except Exception:  # answered to the waiters it covered (``_answer_loop_waiters``); the rest go on
                log.debug("proxy.snapshot_pump_write_failed", exc_info=True)

    def _answer_loop_waiters(self, write: _Write) -> None:
        """Answer the loop callers ``write`` covered (under ``_cond``): its error, or durable."""
        waiting = []
        for target, future, loop in self._loop_waiters:
            if target <= write.covers:
                with suppress(RuntimeError):  # its loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(_settle, future, write.error)
            else:
                waiting.append((target, future, loop))
        self._loop_waiters = waiting

    def _put(self) -> bool:
        """Put what changed since the last put (a segment, or the whole snapshot when a compaction is due); False
        if Redis holds no state (nothing to write)."""
        key = bucket_keys.proxy_snapshot_key(self.store.run)
        try:
            epoch = 0 if self.leadership is None else self.leadership.confirm()
            if not self._seen:
                self._see(key, epoch)
            # A new epoch compacts first, so the snapshot always carries the epoch of every segment after it
            # (the floor a new leadership starts above, ``take_leadership``).
            compact = (
                self._must_compact
                or epoch != self._epoch
                or self.policy.due(self._segments, self._log_bytes, self._snapshot_bytes)
            )
            if not compact and self.monotonic() - self._checked_at >= LEADERSHIP_CHECK_S:
                compact = self._snapshot_replaced(key, epoch)
            if not compact:
                appended = self._append(epoch)
                if appended is not None:
                    return appended
            return self._compact(key, epoch)
        except ObjectChanged as error:
            self._seen = False
            raise SnapshotFailed(
                f"the proxy snapshot of run {self.store.run!r} changed again while it was written: {error}"
            ) from error
        except (BucketError, OSError) as error:
            self._seen = False  # the put may have landed: read the ETag again before the next one
            raise SnapshotFailed(f"could not write the proxy snapshot of run {self.store.run!r}: {error}") from error

    def _snapshot_replaced(self, key: str, epoch: int) -> bool:
        """Whether the snapshot is no longer the one this writer put (then a compaction is due); raises
        ``LeadershipLost`` if a proxy of a higher epoch wrote it."""
        self._checked_at = self.monotonic()
        try:
            _, etag = self.bucket.get_tagged(key)
        except ObjectNotFound:
            etag = None
        if etag == self._etag:
            return False
        self._see(key, epoch)
        return True

    def _fenced(self, what: str, epoch: int) -> SnapshotFailed:
        """A script found the leadership not held at ``epoch``: ``LeadershipLost`` if another proxy holds it now."""
        if self.leadership is not None:
            self.leadership.check_taken()
        return SnapshotFailed(f"the leadership of run {self.store.run!r} moved on from epoch {epoch} before its {what}")

    def _append(self, epoch: int) -> bool | None:
        """Put the next log segment; None where a compaction must be put instead (none since the state was built,
        or a segment of this number is in the bucket already)."""
        run = self.store.run
        header = json.dumps(
            {"format": SNAPSHOT_FORMAT, "run": run, "proxy_epoch": epoch, "written_at_ms": self.store.clock_ms()}
        )
        try:
            reply = self.store.scripts.log_segment(header_json=header, epoch=epoch)
        except StateMissing:
            return False
        if reply.code == "COMPACT":
            return None
        if reply.code == "FENCED":
            raise self._fenced("log segment", epoch)
        key, data = bucket_keys.proxy_log_key(run, reply["seq"]), seal(reply["segment"].encode())
        if self.leadership is not None:
            self.leadership.confirm()  # atomically in Redis, as close to the put as it gets
        try:
            self.bucket.put_if_match(key, data, None)
        except ObjectChanged:
            # A segment of this number exists: a proxy of a higher epoch (on another Redis) fences this one;
            # otherwise it is this proxy's own from before a rebuild. A compaction covers it either way.
            theirs = snapshot_epoch(self.bucket.get(key))
            if self.leadership is not None and theirs > epoch:
                raise LeadershipLost(
                    f"{key} was written by a proxy of epoch {theirs}, above this proxy's {epoch}: another proxy "
                    f"coordinates run {run!r} (check ASYNCGRPO_REDIS_URL: both must share one Redis); this one stops"
                ) from None
            log.warning("proxy.log_segment_exists", run=run, key=key, epoch=epoch)
            return None
        self._segments += 1
        self._log_bytes += len(data)
        self.put_bytes += len(data)
        self.on_written(False, len(data))
        return True

    def _compact(self, key: str, epoch: int) -> bool:
        """Put the whole snapshot over the one this writer last saw; the log starts anew from it."""
        read = _read_state_json(self.store, epoch, compact=True)
        if read is None:
            return False
        data, through = read
        if data is None:
            raise self._fenced("compaction", epoch)
        if self.leadership is not None:
            self.leadership.confirm()  # atomically in Redis, as close to the put as it gets
        try:
            self._etag = self.bucket.put_if_match(key, data, self._etag)
        except ObjectChanged:
            # Written by someone else since: a proxy of a higher epoch fences this one (LeadershipLost). A lower
            # or equal epoch is a late put of a deposed proxy (or of this one, its answer lost) that this
            # proxy's Redis state already holds, or an operator's edit: put over it, once.
            self._see(key, epoch)
            log.warning("proxy.snapshot_changed_underneath", run=self.store.run, epoch=epoch)
            self._etag = self.bucket.put_if_match(key, data, self._etag)
        self._checked_at, self._epoch = self.monotonic(), epoch
        self.compactions += 1
        self.put_bytes += len(data)
        self.on_written(True, len(data))
        self._must_compact = False
        self._segments, self._log_bytes, self._snapshot_bytes = 0, 0, len(data)
        self._collect_through = through
        return True

    def _collect_log(self) -> None:
        """Delete the segments the last compaction covers (best effort: a rebuild passes over them anyway, and
        the next compaction tries again)."""
        through, self._collect_through = self._collect_through, 0
        if not through:
            return
        run = self.store.run
        try:
            keys = self.bucket.list(bucket_keys.proxy_log_prefix(run))
            covered = [key for key in keys if (seq := bucket_keys.seq_from_log_key(key)) and seq <= through]
            self.bucket.delete_keys(covered)
        except (BucketError, OSError) as error:
            log.warning("proxy.log_collect_failed", run=run, through=through, error=str(error))

    def _see(self, key: str, epoch: int) -> None:
        """Read the snapshot's ETag (None: there is none), after checking that no proxy of a higher epoch wrote
        it (two proxies on two Redis: a wrong ASYNCGRPO_REDIS_URL)."""
        try:
            data, etag = self.bucket.get_tagged(key)
        except ObjectNotFound:
            self._seen, self._etag = True, None
            return
        theirs = snapshot_epoch(data)
        if self.leadership is not None:
            self.leadership.raise_floor(theirs)
            if theirs > epoch:
                self.leadership.lost = self.leadership.lost or Leader("?", theirs, "unknown (seen in the bucket)", 0, 0)
                raise LeadershipLost(
                    f"{key} was written by a proxy of epoch {theirs}, above this proxy's {epoch}: another proxy "
                    f"coordinates run {self.store.run!r} (check ASYNCGRPO_REDIS_URL: both must share one Redis); "
                    "this one stops coordinating"
                )
        self._seen, self._etag = True, etag
