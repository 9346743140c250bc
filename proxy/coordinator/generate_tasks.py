"""Generate tasks: dispatch one (requeued prompts first, then the seeded permutation), cancel and expire them.

The prompt order is a seeded permutation per epoch (``seed + epoch``); its position lives in Redis (``epoch``,
``epoch_pos``), so a restarted proxy goes on where it was. A task is dispatched only while in-flight plus
buffered groups stay within the paced limit (``proxy.coordinator.pacing``, at most ``async.queue_maxsize``);
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
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import structlog

from asyncgrpo.protocol.schemas import GenerateTaskMessage, GroupRef
from asyncgrpo.run.config import RunConfig
from proxy.coordinator.errors import BufferFull, EpochMoved
from proxy.coordinator.redis_store import RedisStore, halt
from proxy.coordinator.retention import track_flag
from proxy.coordinator.rollouts import MAX_REJECT_REASONS, normalise_reason

log = structlog.get_logger()

QUARANTINE_HALT = "prompts_quarantined"
"""The halt source (``proxy.coordinator.step_failures``) of a run whose every prompt is quarantined."""

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
        # Groups allowed in flight plus buffered (``proxy.coordinator.pacing``); queue_maxsize when not paced.
        self.inflight_limit = inflight_limit or (lambda: self.config.queue_maxsize)
        self.num_prompts = num_prompts
        self.order = PromptOrder(config.seed, num_prompts)

    def unattended_groups(self) -> int:
        """Groups of in-flight tasks no worker is known to work on (leased, no live lease): the paced limit leaves
        them out, so a ghost task does not hold the room a step needs (``lua/unattended_groups.lua``)."""
        reply = self.store.scripts.unattended_groups(now_ms=self.store.clock_ms())
        return int(reply["groups"])

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
            groups = [GroupRef(**g) for g in json.loads(reply["groups_json"])]
            return GenerateTaskMessage(
                run=store.run, task_id=reply["task_id"], groups=groups, expires_at=deadline / 1000.0
            )
        raise RuntimeError("dispatch_generate kept seeing the epoch position move; is a second proxy running?")

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
        undone = int(reply["tasks_undone"])
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
        tasks, groups, rejected = (
            int(reply[name]) for name in ("tasks_cancelled", "groups_requeued", "groups_rejected")
        )
        if tasks:
            self.store.mark_changed()
            log.warning(
                "proxy.tasks_cancelled", tasks=tasks, groups_requeued=groups, groups_rejected=rejected, why=mode
            )
        return tasks, groups, rejected
