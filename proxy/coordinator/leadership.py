"""One live proxy per run, its leadership: a lease in Redis that carries a fencing epoch (invariant 6).

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

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import structlog
from redis import Redis

from proxy.coordinator.errors import CoordinatorError, SnapshotFailed
from proxy.coordinator.redis_keys import RunKeys

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
