"""Bottleneck accounting: how long dispatch was held back by a full buffer, and how long the trainer starved.

Between two ticks the state stays what the previous tick left (submits and publishes wake a tick at once),
so the conditions seen at the end of a tick are credited with the whole gap to the next one. The totals are
Redis counters in milliseconds (``dispatch_backpressure_ms``, ``trainer_starved_ms``), so they survive a proxy
restart; ``/metrics`` exports them in seconds.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncgrpo.run.config import RunConfig
from proxy.coordinator.store import RunStore


class WaitingAccount:
    """Credits the time between ticks to what the proxy was waiting on."""

    def __init__(self, store: RunStore, config: RunConfig, inflight_limit: Callable[[], int] | None = None) -> None:
        self.store = store
        self.config = config
        self.inflight_limit = inflight_limit or (lambda: config.async_.queue_maxsize)
        # The end of the previous tick and what the proxy saw then: (ms, held back, trainer starved).
        self._last_tick: tuple[int, bool, bool] | None = None

    def account(self) -> None:
        """At the end of a tick: credit the time since the previous tick to what the proxy saw at its end.

        The first tick of a process credits nothing, as the gap before it is unknown.
        """
        now = self.store.clock_ms()
        if self._last_tick is not None:
            since_ms, held_back, starved = self._last_tick
            elapsed_ms = max(0, now - since_ms)
            if elapsed_ms and held_back:
                self.store.count("dispatch_backpressure_ms", elapsed_ms)
            if elapsed_ms and starved:
                self.store.count("trainer_starved_ms", elapsed_ms)
        self._last_tick = (now, *self.waiting_now())

    def waiting_now(self) -> tuple[bool, bool]:
        """(dispatch held back by a full buffer, trainer starved of groups), as the state is now."""
        cfg = self.config.async_
        fields = {"current_version": -1, "step_inflight": -1, "groups_inflight": 0, "groups_buffered": 0}
        raw = self.store.redis.hmget(self.store.keys.state, list(fields))
        current, step_inflight, inflight, buffered = (
            default if value is None else int(value) for value, default in zip(raw, fields.values(), strict=True)
        )
        if current >= self.config.final_version:
            return False, False
        held_back = inflight + buffered + cfg.groups_per_task > self.inflight_limit()
        starved = step_inflight < 0 and current >= 0 and buffered < cfg.groups_per_step * cfg.publish_every
        return held_back, starved
