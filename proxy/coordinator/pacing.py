"""In-flight pacing: how many groups the proxy keeps in flight plus buffered, sized from the rates it measures.

A full buffer keeps the trainer fed, but when the trainer is the bottleneck its samples are as old as the
buffer is deep. The proxy therefore measures, in this process:

- the trainer's time per step: from sending a step's optimize task to its publish;
- a generate task's service time: from its lease to its submission (queue waiting excluded, so a deep
  queue does not inflate the estimate that keeps it deep), and how many generate workers submitted
  recently (tasks of one worker run one after another);

and keeps ``versions_ahead * groups_per_version`` groups in flight plus buffered, where ``versions_ahead``
is the number of trainer steps the fleet needs to produce one version's worth of groups (1 when it
produces them within one step: each step's batch is then made while the previous step trains, staleness
1). ``async.queue_maxsize`` stays the upper bound. Until enough has been measured (a fresh or restarted
proxy) the limit is two versions' worth; with ``async.adaptive_inflight = false`` it is ``queue_maxsize``.

``WaitingAccount`` credits the time a full buffer held dispatch back and the time the trainer starved: the
two sides of the same balance, shown as the bottleneck pair of metrics.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Callable

from asyncgrpo.run.config import AsyncConfig, RunConfig
from proxy.coordinator.redis_store import RedisStore


class WaitingAccount:
    """Credits the time between ticks to what the proxy was waiting on."""

    def __init__(self, store: RedisStore, config: RunConfig, inflight_limit: Callable[[], int] | None = None) -> None:
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


SAMPLES_KEPT = 20
"""Recent measurements of each kind the estimates are medians of."""
MIN_SAMPLES = 3
"""Measurements of each kind needed before the limit follows them."""
UNMEASURED_VERSIONS_AHEAD = 2
"""Versions' worth of groups in flight before anything is measured (a fresh or restarted proxy)."""
REFILL_MARGIN = 1.0
"""Head-room on the measured refill time. The medians already cover ordinary jitter, and every extra version
of head-room adds one version of staleness to every sample, so none is added by default."""
WAIT_TOLERANCE = 0.1
"""Share of a step the trainer may wait for its next groups before a version of head-room is added: a
refill up to 10 % slower than a step costs at most that much throughput, a version more costs a version
of staleness on every sample."""
DELIVERY_ALLOWANCE_S = 0.01
"""Per round of generate tasks: the broker delivering it and the proxy admitting it."""
WORKER_WINDOW_S = 30.0
"""A generate worker counts as part of the fleet for this long after its last submission."""
MAX_TRACKED_LEASES = 10_000
"""Leases whose start is remembered; older ones are forgotten (a lost task never submits)."""


class InflightPacer:
    """Thread-safe: HTTP handlers report leases, submissions and publishes; dispatch asks for the limit."""

    def __init__(self, config: AsyncConfig, clock_ms: Callable[[], int]) -> None:
        self.enabled = config.adaptive_inflight
        self.queue_maxsize = config.queue_maxsize
        self.groups_per_task = config.groups_per_task
        per_version = config.groups_per_step * config.publish_every
        # The buffer fills in whole tasks: a version's worth, rounded up to whole tasks.
        self.groups_per_version = math.ceil(per_version / self.groups_per_task) * self.groups_per_task
        self.clock_ms = clock_ms
        self._lock = threading.Lock()
        self._leased_ms: dict[str, int] = {}
        self._task_s: deque[float] = deque(maxlen=SAMPLES_KEPT)
        self._step_s: deque[float] = deque(maxlen=SAMPLES_KEPT)
        self._step_sent_ms: dict[int, int] = {}
        self._worker_seen_ms: dict[str, int] = {}

    # ---- what the coordinator reports ----

    def leased(self, task_id: str) -> None:
        with self._lock:
            if task_id in self._leased_ms:
                return  # a renewed or repeated lease: the task started at its first one
            if len(self._leased_ms) >= MAX_TRACKED_LEASES:
                self._leased_ms.pop(next(iter(self._leased_ms)))
            self._leased_ms[task_id] = self.clock_ms()

    def submitted(self, task_id: str, worker_id: str) -> None:
        now = self.clock_ms()
        with self._lock:
            started = self._leased_ms.pop(task_id, None)
            if started is not None:
                self._task_s.append(max(0, now - started) / 1000)
            self._worker_seen_ms[worker_id] = now

    def step_sent(self, step: int) -> None:
        with self._lock:
            self._step_sent_ms[step] = self.clock_ms()  # a re-send restarts the clock: the trainer restarted

    def published(self, step: int) -> None:
        now = self.clock_ms()
        with self._lock:
            sent = self._step_sent_ms.pop(step, None)
            # Older steps can no longer publish; forget them (a step lost to a conflict never reports).
            for old in [s for s in self._step_sent_ms if s < step]:
                del self._step_sent_ms[old]
            if sent is not None and step > 0:  # version 0 is the initialisation, not a training step
                self._step_s.append(max(0, now - sent) / 1000)

    # ---- what dispatch asks ----

    def limit(self) -> int:
        """Groups allowed in flight plus buffered now: at most ``queue_maxsize``, at least one version's worth
        plus one task less a group."""
        if not self.enabled:
            return self.queue_maxsize
        # Until measured: two versions' worth, the trainer's next batch and the one after, not a full buffer
        # whose samples would all be old by the time the trainer reaches them.
        versions_ahead = self.versions_ahead() or UNMEASURED_VERSIONS_AHEAD
        # The floor: with one group short of a step buffered (a rejected group leaves the buffer off the task
        # grid) and nothing in flight, a whole task must still fit, or no step is ever claimed again.
        floor = self.groups_per_version + self.groups_per_task - 1
        return min(self.queue_maxsize, max(floor, versions_ahead * self.groups_per_version))

    def versions_ahead(self) -> int | None:
        """Trainer steps the fleet needs to make one version's groups; None while unmeasured or when off."""
        if not self.enabled:
            return None
        now = self.clock_ms()
        with self._lock:
            if len(self._task_s) < MIN_SAMPLES or len(self._step_s) < MIN_SAMPLES:
                return None
            task_s = statistics.median(self._task_s)
            step_s = statistics.median(self._step_s)
            window_ms = max(WORKER_WINDOW_S, 10 * task_s) * 1000
            for worker in [w for w, seen in self._worker_seen_ms.items() if now - seen > window_ms]:
                del self._worker_seen_ms[worker]
            workers = max(1, len(self._worker_seen_ms))
        tasks = self.groups_per_version // self.groups_per_task
        rounds = math.ceil(tasks / workers)
        refill_s = rounds * (task_s + DELIVERY_ALLOWANCE_S) * REFILL_MARGIN
        return max(1, math.ceil(refill_s / max(step_s, 1e-3) - WAIT_TOLERANCE))
