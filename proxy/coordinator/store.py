"""The store of one run's coordinator state: the Redis client, the key names, the clock and the scripts.

Every module of the coordinator reaches Redis through a ``RunStore``. It owns what they share: the client
(made with ``decode_responses=True``), ``RunKeys``, the injectable clock in milliseconds (by default Redis
``TIME``, so every proxy and host agrees on deadlines; tests pass their own, so no test sleeps), how long
finished records stay (``record_ttl_s``), the scripts bound to this client, and
a change counter that tells the snapshot writer whether anything changed since the last snapshot.

A script that finds no state for the run (Redis was flushed or restarted empty) makes the store call its
``rebuild`` once (the coordinator's ``ensure_state``) and run the script again; a second miss raises
``StateMissing``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from redis import Redis

from proxy.coordinator.lua_script import BoundScript, LuaScript
from proxy.coordinator.redis_keys import RunKeys
from proxy.coordinator.scripts import Scripts

RECORD_TTL_S = 7 * 24 * 3600
"""Finished group/task/rollout/step records stay this long in Redis (for inspection), then expire."""


def wall_clock_ms(redis: Redis) -> int:
    """Now in milliseconds by Redis ``TIME``: deadlines written by one proxy mean the same to the next one,
    whatever the skew between their hosts' clocks."""
    seconds, micros = redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


class RunStore:
    """Redis, keys, clock and scripts of one run; ``rebuild`` restores an empty Redis (see the module doc)."""

    def __init__(
        self,
        redis: Redis,
        run: str,
        *,
        rebuild: Callable[[], object],
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
        self._rebuild = rebuild
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
            self._rebuild,
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
