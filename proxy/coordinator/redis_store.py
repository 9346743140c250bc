"""The store of one run's coordinator state: the Redis client, the key names, the clock and the scripts.

Every module of the coordinator reaches Redis through a ``RedisStore``. It owns what they share: the client
(made with ``decode_responses=True``), ``RunKeys``, the injectable clock in milliseconds (by default Redis
``TIME``, so every proxy and host agrees on deadlines; tests pass their own, so no test sleeps), how long
finished records stay (``record_ttl_s``), the scripts bound to this client, and
a change counter that tells the snapshot writer whether anything changed since the last snapshot.

A script that finds no state for the run (Redis was flushed or restarted empty) raises ``StateMissing``; the
coordinator's entry points (``service.Coordinator``) then rebuild the state from the bucket and call again.

The run's halt (``halt``, ``clear_halt``, ``halted_reason``) is a reason string in the state hash that stops
steps from being claimed or sent: a fault no worker can get past on its own (every live trainer failed to load
the base version of the step in flight, or the current version is corrupted). The run waits, visibly, for an
operator instead of re-sending a step that cannot succeed: ``/v1/status`` and ``asyncgrpo status`` show the
reason, the ``asyncgrpo_run_halted`` gauge is 1 and the ``AsyncgrpoRunHalted`` alert fires. Each halt names
its source (``by``), so a source clears only its own halt once the cause is gone; generation goes on meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog
from redis import Redis

from proxy.coordinator.redis_keys import RunKeys
from proxy.coordinator.scripts import BoundScript, LuaScript, Scripts

RECORD_TTL_S = 7 * 24 * 3600
"""Finished group/task/rollout/step records stay this long in Redis (for inspection), then expire."""

log = structlog.get_logger()


def wall_clock_ms(redis: Redis) -> int:
    """Now in milliseconds by Redis ``TIME``: deadlines written by one proxy mean the same to the next one,
    whatever the skew between their hosts' clocks."""
    seconds, micros = redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


class RedisStore:
    """Redis, keys, clock and scripts of one run."""

    def __init__(
        self,
        redis: Redis,
        run: str,
        *,
        clock_ms: Callable[[], int] | None = None,
        record_ttl_s: int = RECORD_TTL_S,
    ) -> None:
        if not redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("the coordinator needs a Redis client made with decode_responses=True")
        self.redis = redis
        self.run = run
        self.keys = RunKeys(run)
        self.clock_ms = clock_ms if clock_ms is not None else lambda: wall_clock_ms(redis)
        self.record_ttl_s = record_ttl_s
        self.scripts = Scripts(self._bind)
        self._changes_lock = threading.Lock()
        self._changes = 0

    def _bind(self, script: LuaScript) -> BoundScript:
        return BoundScript(
            script,
            self.redis,
            lambda name: getattr(self.keys, name),
            self.keys.prefix,
            self.run,
        )

    def has_state(self) -> bool:
        return bool(self.redis.exists(self.keys.state))

    def current_version(self) -> int:
        value = self.redis.hget(self.keys.state, "current_version")
        return -1 if value is None else int(value)

    def count(self, counter: str, amount: int = 1) -> None:
        """Add to a counter of ``/v1/status`` an event decided outside Redis."""
        self.scripts.add_counter(counter=counter, amount=amount)

    def mark_changed(self) -> int:
        """Something the snapshot holds changed (call it after the change): returns the change's number, which
        ``SnapshotWriter.write_through`` makes durable."""
        with self._changes_lock:
            self._changes += 1
            return self._changes

    @property
    def changes(self) -> int:
        with self._changes_lock:
            return self._changes


HALTED_FIELD = "halted"
HALTED_BY_FIELD = "halted_by"


def halted_reason(store: RedisStore) -> str | None:
    """The reason the run is halted, or None when it is not."""
    return store.redis.hget(store.keys.state, HALTED_FIELD) or None


def halt(store: RedisStore, reason: str, *, by: str) -> None:
    """Halt the run's steps with ``reason`` (a sentence naming what to fix); ``by`` names the source.

    Logged (at error level) once per new reason: sources re-assert their halt on every check."""
    if halted_reason(store) == reason:
        return
    store.scripts.set_halt(reason=reason, by=by)
    store.mark_changed()
    log.error("proxy.run_halted", reason=reason, by=by)


def clear_halt(store: RedisStore, *, by: str) -> bool:
    """Lift a halt set by ``by`` (another source's halt stays); True if one was lifted."""
    lifted = store.scripts.clear_halt(by=by)["cleared"] > 0
    if lifted:
        store.mark_changed()
        log.warning("proxy.run_halt_cleared", by=by)
    return lifted
