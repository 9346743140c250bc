"""Generate tasks: dispatch one (requeued prompts first, then the seeded permutation), cancel and expire them.

The prompt order is a seeded permutation per epoch (``seed + epoch``); its position lives in Redis (``epoch``,
``epoch_pos``), so a restarted proxy goes on where it was. A task is dispatched only while in-flight plus
buffered groups stay within the paced limit (``InflightPacer`` below, at most ``async.queue_maxsize``);
groups of tasks that no worker is known to work on (leased, but no lease of theirs is live) are not counted
against the paced limit, so a task whose worker vanished does not hold the room the next step needs;
``async.queue_maxsize`` bounds every group, unattended or not. A task not submitted by its deadline
(``async.generate_task_timeout_s``) is presumed lost: it is cancelled and its prompts go back in line
(invariant 4); a task the broker refused is cancelled at once (``force``).

Invariants 8 and 9: a task whose lease holder stopped sending heartbeats is cancelled at once (``reap_dead``),
and so is one whose worker reports a failure (``fail``). A timed-out, dead-worker or failed task counts one
failed attempt for each of its prompts (``prompt_attempts``; cleared when the prompt's task runs to a
submission); at ``async.max_group_attempts`` the group ends as rejected instead of requeued, with the last
reported reason or ``failed_<n>_attempts``, and its prompt is quarantined: never dispatched again
(``prompts_quarantined``), or a poison prompt would fail that many times more every epoch. A failure the
worker says is not the prompts' fault (an adapter version it could not load) counts no attempt. Tasks a failed
snapshot would not make durable were never sent: ``undo`` takes them back without counting anything, their
prompts at the front of the line.

In-flight pacing: how many groups the proxy keeps in flight plus buffered, sized from the rates it measures.

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

Fleet size, the autoscaling signal (``InflightPacer.fleet``): from the same measurements, the generate workers
that keep the trainer busy. The trainer takes one version's tasks per step (``tasks_per_version``); a worker
serves one task per ``task_s`` plus its delivery, so the fleet keeps up when it serves that many tasks per
step: ``wanted = ceil(tasks_per_version * (task_s + delivery) / step_s)``. At ``max_staleness = 0`` each batch
is sampled only after the previous publish, so more than one round of tasks (``tasks_per_version`` workers)
cannot help. Workers beyond the tasks ``queue_maxsize`` admits in flight would only wait: that is the cap.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
from collections import deque
from collections.abc import Callable

import structlog

from asyncgrpo.protocol.schemas import FleetView, GenerateTaskMessage, GroupRef
from asyncgrpo.run.config import AsyncConfig, RunConfig
from proxy.coordinator.dispatch import Dispatcher, DispatchError
from proxy.coordinator.leases import track_flag
from proxy.coordinator.redis_store import RedisStore, halt
from proxy.coordinator.rollouts import MAX_REJECT_REASONS, normalise_reason
from proxy.coordinator.scripts import BufferFull, EpochMoved


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
PRUNE_EVERY_MS = 1000
"""How often the workers seen submitting are pruned to the window (a second's error in a 30 s window)."""
MAX_TRACKED_LEASES = 10_000
"""Leases whose start is remembered; older ones are forgotten (a lost task never submits)."""


def workers_wanted(
    *, tasks_per_version: int, task_s: float, step_s: float, max_staleness: int, max_tasks_inflight: int
) -> int:
    """Generate workers that keep a trainer taking ``step_s`` per version busy (module docstring)."""
    if max_staleness == 0:
        wanted = tasks_per_version
    else:
        wanted = math.ceil(tasks_per_version * (task_s + DELIVERY_ALLOWANCE_S) / max(step_s, 1e-3))
    return max(1, min(wanted, max_tasks_inflight))


class InflightPacer:
    """Thread-safe: HTTP handlers report leases, submissions and publishes; dispatch asks for the limit."""

    def __init__(self, config: AsyncConfig, clock_ms: Callable[[], int]) -> None:
        self.enabled = config.adaptive_inflight
        self.queue_maxsize = config.queue_maxsize
        self.max_staleness = config.max_staleness
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
        self._pruned_ms = -PRUNE_EVERY_MS

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
        measured = self._measured()
        if measured is None:
            return None
        task_s, step_s, workers = measured
        tasks = self.groups_per_version // self.groups_per_task
        rounds = math.ceil(tasks / max(1, workers))
        refill_s = rounds * (task_s + DELIVERY_ALLOWANCE_S) * REFILL_MARGIN
        return max(1, math.ceil(refill_s / max(step_s, 1e-3) - WAIT_TOLERANCE))

    def fleet(self) -> FleetView | None:
        """The generate workers wanted now and what it is computed from; None until measured (whether or not
        pacing is on: the measurements are the same)."""
        measured = self._measured()
        if measured is None:
            return None
        task_s, step_s, workers = measured
        tasks = self.groups_per_version // self.groups_per_task
        wanted = workers_wanted(
            tasks_per_version=tasks,
            task_s=task_s,
            step_s=step_s,
            max_staleness=self.max_staleness,
            max_tasks_inflight=max(1, self.queue_maxsize // self.groups_per_task),
        )
        return FleetView(step_s=step_s, task_s=task_s, tasks_per_version=tasks, submitting=workers, wanted=wanted)

    def _measured(self) -> tuple[float, float, int] | None:
        """(median task seconds, median step seconds, workers submitting) once enough of each is measured."""
        now = self.clock_ms()
        with self._lock:
            if len(self._task_s) < MIN_SAMPLES or len(self._step_s) < MIN_SAMPLES:
                return None
            task_s = statistics.median(self._task_s)
            step_s = statistics.median(self._step_s)
            # Pruned once a second, not at every call: every round asks, and the scan is O(workers).
            if now - self._pruned_ms >= PRUNE_EVERY_MS:
                self._pruned_ms = now
                window_ms = max(WORKER_WINDOW_S, 10 * task_s) * 1000
                for worker in [w for w, seen in self._worker_seen_ms.items() if now - seen > window_ms]:
                    del self._worker_seen_ms[worker]
            return task_s, step_s, len(self._worker_seen_ms)


log = structlog.get_logger()

QUARANTINE_HALT = "prompts_quarantined"
"""The halt source (``proxy.coordinator.steps``) of a run whose every prompt is quarantined."""

_DISPATCH_ATTEMPTS = 8
"""How often a dispatch re-reads a prompt order position that moved under it before it gives up."""


class PromptOrder:
    """The seeded permutation of each epoch, kept for the current and the previous epoch only."""

    def __init__(self, seed: int, num_prompts: int) -> None:
        self.seed = seed
        self.num_prompts = num_prompts
        self._permutations: dict[int, list[int]] = {}

    def permutation(self, epoch: int) -> list[int]:
        perm = self._permutations.get(epoch)
        if perm is None:
            perm = list(range(self.num_prompts))
            random.Random(self.seed + epoch).shuffle(perm)
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            self._permutations[epoch] = perm
        return perm

    def candidates(self, epoch: int, pos: int, count: int) -> list[int]:
        """The next ``count`` prompt indices from (epoch, pos) on, crossing into the next epoch if needed."""
        out: list[int] = []
        while len(out) < count:
            perm = self.permutation(epoch)
            take = perm[pos : pos + count - len(out)]
            out.extend(take)
            pos += len(take)
            if pos >= self.num_prompts:
                epoch, pos = epoch + 1, 0
        return out


class GenerateTasks:
    """Dispatch, cancel and expire the generate tasks of one run."""

    def __init__(
        self, store: RedisStore, config: RunConfig, num_prompts: int, inflight_limit: Callable[[], int] | None = None
    ) -> None:
        self.store = store
        self.config = config.async_
        # Groups allowed in flight plus buffered (``proxy.coordinator.generate_tasks``); queue_maxsize when not paced.
        self.inflight_limit = inflight_limit or (lambda: self.config.queue_maxsize)
        self.num_prompts = num_prompts
        self.order = PromptOrder(config.seed, num_prompts)

    def unattended_groups(self) -> int:
        """Groups of in-flight tasks no worker is known to work on (leased, no live lease): the paced limit leaves
        them out, so a ghost task does not hold the room a step needs (``lua/unattended_groups.lua``)."""
        reply = self.store.scripts.unattended_groups(now_ms=self.store.clock_ms())
        return reply["groups"]

    def dispatch_one(self, unattended: int = 0) -> GenerateTaskMessage | None:
        """Create one generate task if the buffer has room (the caller sends it); None when full. ``unattended``:
        groups in flight that the paced limit does not count (``unattended_groups``); ``async.queue_maxsize``
        counts them all."""
        store, cfg = self.store, self.config
        for _ in range(_DISPATCH_ATTEMPTS):
            epoch_raw, pos_raw = store.redis.hmget(store.keys.state, ["epoch", "epoch_pos"])
            epoch, pos = int(epoch_raw or 0), int(pos_raw or 0)
            deadline = store.clock_ms() + int(cfg.generate_task_timeout_s * 1000)
            # Quarantined prompts are skipped: enough candidates that groups_per_task of them are not.
            quarantined = int(store.redis.hget(store.keys.prompt_attempts, "quarantined") or 0)
            if quarantined >= self.num_prompts:
                halt(
                    store,
                    f"all {self.num_prompts} prompts of run {store.run!r} are quarantined (each failed "
                    f"async.max_group_attempts times; see rejected_by_reason): fix the reward or the data and "
                    "create a new run",
                    by=QUARANTINE_HALT,
                )
                return None
            try:
                reply = store.scripts.dispatch_generate(
                    now_ms=store.clock_ms(),
                    deadline_ms=deadline,
                    groups_per_task=cfg.groups_per_task,
                    # Ghosts get their room back from pacing, never beyond the hard bound.
                    queue_maxsize=min(cfg.queue_maxsize, self.inflight_limit() + unattended),
                    epoch=epoch,
                    epoch_pos=pos,
                    num_prompts=self.num_prompts,
                    run=store.run,
                    candidates=self.order.candidates(epoch, pos, cfg.groups_per_task + quarantined),
                )
            except BufferFull:
                return None
            except EpochMoved:
                continue
            store.mark_changed()
            groups = [GroupRef(**g) for g in reply["groups_json"]]
            return GenerateTaskMessage(
                run=store.run, task_id=reply["task_id"], groups=groups, expires_at=deadline / 1000.0
            )
        raise RuntimeError("dispatch_generate kept seeing the epoch position move; is a second proxy running?")

    def dispatch(self, most: int) -> tuple[list[GenerateTaskMessage], int]:
        """Up to ``most`` new tasks while the buffer has room (the caller snapshots, then sends them), and the
        groups in flight that no worker is known to work on (``unattended_groups``, left out of the paced limit
        but not out of ``queue_maxsize``)."""
        unattended = self.unattended_groups()
        messages: list[GenerateTaskMessage] = []
        while len(messages) < most:
            message = self.dispatch_one(unattended)
            if message is None:
                break
            messages.append(message)
        return messages, unattended

    def send(self, messages: list[GenerateTaskMessage], dispatcher: Dispatcher) -> list[str]:
        """Send new tasks to the queue; a task the broker refused is cancelled at once (its groups go back in
        line). Returns the ids sent."""
        sent, unsent = [], []
        for message in messages:
            try:
                dispatcher.send_generate(message)
                sent.append(message.task_id)
            except DispatchError as error:
                log.warning("proxy.generate_send_failed", task_id=message.task_id, error=str(error))
                unsent.append(message.task_id)
        self.cancel(unsent, force=True)
        return sent

    def tick(self, alive_s: float) -> tuple[int, int]:
        """Housekeeping's part here: cancel the tasks past their deadline, then those whose worker was not heard
        from within ``alive_s`` (invariant 8: back in line now, not at their deadline). Returns how many of
        each."""
        cancelled, _ = self.expire()
        return cancelled, self.reap_dead(alive_s)

    def cancel(self, task_ids: list[str], *, force: bool) -> tuple[int, int]:
        """Cancel in-flight tasks (past their deadline, or any if ``force``); returns (tasks, groups requeued)."""
        tasks, groups, _ = self._cancel(task_ids, "force" if force else "deadline")
        return tasks, groups

    def expire(self) -> tuple[int, int]:
        """Cancel the tasks past their deadline; returns (tasks, groups requeued)."""
        due = self.store.redis.zrangebyscore(self.store.keys.tasks_inflight, "-inf", self.store.clock_ms())
        return self.cancel(list(due), force=False)

    # ---- invariants 8 and 9: dead workers, reported failures, attempts, undone dispatches ----

    def reap_dead(self, alive_s: float) -> int:
        """Cancel the tasks whose lease holder was not heard from within ``alive_s``; returns how many."""
        inflight = list(self.store.redis.zrange(self.store.keys.tasks_inflight, 0, -1))
        alive_since = self.store.clock_ms() - int(alive_s * 1000)
        tasks, _, _ = self._cancel(inflight, "dead", alive_since_ms=alive_since)
        return tasks

    def fail(self, task_id: str, worker_id: str, reason: str, *, prompt_at_fault: bool = True) -> bool:
        """A worker reports that ``task_id`` failed: cancel it now, counting an attempt unless the failure is
        not its prompts' fault; False if it was not in flight (or another worker holds it)."""
        mode = "failed" if prompt_at_fault else "failed_uncounted"
        tasks, _, _ = self._cancel([task_id], mode, reason=self._reason_label(reason), worker_id=worker_id)
        return tasks > 0

    def undo(self, task_ids: list[str]) -> int:
        """Take back tasks never sent (their snapshot failed): nothing counted, prompts back in front."""
        if not task_ids:
            return 0
        reply = self.store.scripts.undo_dispatch(task_ids=task_ids)
        undone = reply["tasks_undone"]
        if undone:
            self.store.mark_changed()
        return undone

    def _reason_label(self, reason: str) -> str:
        label = normalise_reason(reason)
        known = set(self.store.redis.hkeys(self.store.keys.rejected_reasons))
        return label if label in known or len(known) < MAX_REJECT_REASONS else "other"

    def _cancel(
        self, task_ids: list[str], mode: str, *, reason: str = "", worker_id: str = "", alive_since_ms: int = 0
    ) -> tuple[int, int, int]:
        """Run CANCEL_TASKS in ``mode``; returns (tasks cancelled, groups requeued, groups rejected)."""
        if not task_ids:
            return 0, 0, 0
        reply = self.store.scripts.cancel_tasks(
            now_ms=self.store.clock_ms(),
            record_ttl_s=self.store.record_ttl_s,
            mode=mode,
            track=track_flag(self.config),
            max_attempts=self.config.max_group_attempts,
            reason=reason,
            alive_since_ms=alive_since_ms,
            worker_id=worker_id,
            task_ids=task_ids,
        )
        tasks, groups, rejected = (reply[name] for name in ("tasks_cancelled", "groups_requeued", "groups_rejected"))
        if tasks:
            self.store.mark_changed()
            log.warning(
                "proxy.tasks_cancelled", tasks=tasks, groups_requeued=groups, groups_rejected=rejected, why=mode
            )
        return tasks, groups, rejected
