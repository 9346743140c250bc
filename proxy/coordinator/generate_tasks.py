"""Generate tasks: dispatch one (requeued prompts first, then the seeded permutation), cancel and expire them.

The prompt order is a seeded permutation per epoch (``seed + epoch``); its position lives in Redis
(``epoch``, ``epoch_pos``), so a restarted proxy goes on where it was. A task is dispatched only while
in-flight plus buffered groups stay within ``async.queue_maxsize`` (back-pressure). A task not submitted by
its deadline (``async.generate_task_timeout_s``) is presumed lost: it is cancelled and its prompts go back in
line (invariant 4); a task the broker refused or that a failed snapshot would not make durable is cancelled
at once (``force``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import structlog

from proxy.coordinator.errors import BufferFull, EpochMoved
from proxy.coordinator.retention import track_flag
from proxy.coordinator.store import RunStore
from proxy.protocol.schemas import GenerateTaskMessage, GroupRef
from proxy.run.config import RunConfig

log = structlog.get_logger()

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
        self, store: RunStore, config: RunConfig, num_prompts: int, inflight_limit: Callable[[], int] | None = None
    ) -> None:
        self.store = store
        self.config = config.async_
        # Groups allowed in flight plus buffered (``proxy.coordinator.pacing``); queue_maxsize when not paced.
        self.inflight_limit = inflight_limit or (lambda: self.config.queue_maxsize)
        self.num_prompts = num_prompts
        self.order = PromptOrder(config.seed, num_prompts)

    def dispatch_one(self) -> GenerateTaskMessage | None:
        """Create one generate task if the buffer has room (the caller sends it); None when full."""
        store, cfg = self.store, self.config
        for _ in range(_DISPATCH_ATTEMPTS):
            epoch_raw, pos_raw = store.redis.hmget(store.keys.state, ["epoch", "epoch_pos"])
            epoch, pos = int(epoch_raw or 0), int(pos_raw or 0)
            deadline = store.clock_ms() + int(cfg.generate_task_timeout_s * 1000)
            try:
                reply = store.scripts.dispatch_generate(
                    now_ms=store.clock_ms(),
                    deadline_ms=deadline,
                    groups_per_task=cfg.groups_per_task,
                    queue_maxsize=self.inflight_limit(),
                    epoch=epoch,
                    epoch_pos=pos,
                    num_prompts=self.num_prompts,
                    run=store.run,
                    candidates=self.order.candidates(epoch, pos, cfg.groups_per_task),
                )
            except BufferFull:
                return None
            except EpochMoved:
                continue
            store.mark_changed()
            groups = [GroupRef(**g) for g in json.loads(reply["groups_json"])]
            return GenerateTaskMessage(run=store.run, task_id=reply["task_id"], groups=groups)
        raise RuntimeError("dispatch_generate kept seeing the epoch position move; is a second proxy running?")

    def cancel(self, task_ids: list[str], *, force: bool) -> tuple[int, int]:
        """Cancel in-flight tasks (past their deadline, or any if ``force``); returns (tasks, groups)."""
        if not task_ids:
            return 0, 0
        reply = self.store.scripts.cancel_tasks(
            now_ms=self.store.clock_ms(),
            record_ttl_s=self.store.record_ttl_s,
            force="1" if force else "0",
            track=track_flag(self.config),
            task_ids=task_ids,
        )
        tasks, groups = int(reply["tasks_cancelled"]), int(reply["groups_requeued"])
        if tasks:
            self.store.mark_changed()
            log.warning("proxy.tasks_cancelled", tasks=tasks, groups_requeued=groups, forced=force)
        return tasks, groups

    def expire(self) -> tuple[int, int]:
        """Cancel the tasks past their deadline; returns (tasks, groups)."""
        due = self.store.redis.zrangebyscore(self.store.keys.tasks_inflight, "-inf", self.store.clock_ms())
        return self.cancel(list(due), force=False)
