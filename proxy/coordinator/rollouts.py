"""Rollout submission: admit a generate task's rollout into the buffer iff it is fresh enough.

A rollout made with version ``n`` is admitted iff ``current - n <= async.max_staleness`` (invariant 2);
a stale one is counted and its prompts are requeued. ``n`` is the rollout's oldest token's version (the one
it leased, or an older one where it continues a partial sequence an earlier task saved); with
``async.stale_tokens = "mask"``, its newest token's, and the trainer masks the tokens older than the window
(``window_version``). The buffered rollout keeps ``n`` as its version, which the claim checks.

Groups the worker rejected (bad input) end with a normalised reason; groups the submission does not mention end
as ``missing_from_rollout``. The snapshot is written before the worker hears "admitted", so an admitted rollout
survives a proxy crash.

A submission is bound to its lease (``lua/submit_rollout.lua``): it must come from the worker holding the
task's lease, with a version (and lease id, when given) that worker leased for the task, and a repeat of an
admitted task must be the admitted rollout (worker, sha256, version). Otherwise ``NotTaskHolder``: nothing
changes, not even the lease it names, and the worker drops its work. Stale and cancelled tasks answer as such
to anyone: those answers already make the worker drop its work.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.protocol.schemas import RolloutSubmission, StaleRolloutError, SubmitResult
from asyncgrpo.run.config import AsyncConfig
from proxy.coordinator.leases import track_flag
from proxy.coordinator.redis_store import LoopScripts, RedisStore
from proxy.coordinator.scripts import ASYNC_CALL_TIMEOUT_S, BadRollout, RolloutTooStale, TaskCancelled, UnknownTask
from proxy.coordinator.snapshot import SnapshotWriter

MAX_REJECT_REASONS = 32
"""Distinct rejection reasons kept as metric labels; further ones are counted as 'other'."""
OMITTED_GROUP_REASON = "missing_from_rollout"


def normalise_reason(reason: str) -> str:
    """A rejection reason as a bounded metric label: lower-case ``[a-z0-9_]``, at most 40 characters."""
    label = re.sub(r"[^a-z0-9_]+", "_", reason.strip().lower()).strip("_")[:40]
    return label or "unspecified"


class RolloutIntake:
    """Admits (or refuses) the rollouts of one run."""

    def __init__(self, store: RedisStore, async_config: AsyncConfig, snapshots: SnapshotWriter) -> None:
        self.store = store
        self.config = async_config
        self.snapshots = snapshots

    def _rejected(self, submission: RolloutSubmission, known_reasons: set[str]) -> list[list[str]]:
        """[[group_id, reason], ...] with reasons normalised and capped at MAX_REJECT_REASONS labels."""
        rejected = []
        for item in submission.rejected_groups:
            reason = normalise_reason(item.reason)
            if reason not in known_reasons and len(known_reasons) >= MAX_REJECT_REASONS:
                reason = "other"
            rejected.append([item.group_id, reason])
        return rejected

    def _values(self, submission: RolloutSubmission, known_reasons: set[str]) -> dict[str, Any]:
        """SUBMIT_ROLLOUT's arguments; raises BadRollout for a key that is not the task's."""
        store = self.store
        expected_key = bucket_keys.rollout_key(store.run, submission.task_id)
        if submission.key != expected_key:
            raise BadRollout(f"rollout key {submission.key!r} must be {expected_key!r} for task {submission.task_id}")
        newest = submission.newest_version
        if newest is not None and newest < submission.version:
            raise BadRollout(
                f"rollout of task {submission.task_id}: newest_version v{newest} is older than its version "
                f"v{submission.version} (the version it leased, its oldest token's)"
            )
        oldest = submission.oldest_version
        if oldest is not None and oldest >= submission.version:
            raise BadRollout(
                f"rollout of task {submission.task_id}: oldest_version v{oldest} is not older than its version "
                f"v{submission.version}; send oldest_version only for tokens older than the leased version"
            )
        ref = {
            "task_id": submission.task_id,
            "key": submission.key,
            "sha256": submission.sha256,
            "version": submission.version,
            "group_ids": submission.group_ids,
        }
        return {
            "now_ms": store.clock_ms(),
            "max_staleness": self.config.max_staleness,
            "record_ttl_s": store.record_ttl_s,
            "task_id": submission.task_id,
            "worker_id": submission.worker_id,
            "version": submission.version,
            "ref_json": json.dumps(ref, separators=(",", ":")),
            "admitted_json": json.dumps(submission.group_ids),
            "rejected_json": json.dumps(self._rejected(submission, known_reasons)),
            "omitted_reason": OMITTED_GROUP_REASON,
            "track": track_flag(self.config),
            "sha256": submission.sha256,
            "lease_id": submission.lease_id or "",
            "window_version": self.window_version(submission),
        }

    def window_version(self, submission: RolloutSubmission) -> int:
        """The version whose staleness decides the rollout's admission and claim: its oldest token's (the leased
        ``version``, or ``oldest_version`` where a sequence continues an older partial one), or with
        ``async.stale_tokens = "mask"`` its newest token's (the older ones are masked)."""
        if self.config.stale_tokens == "mask":
            return submission.newest_version if submission.newest_version is not None else submission.version
        return submission.oldest_version if submission.oldest_version is not None else submission.version

    async def submit(self, submission: RolloutSubmission, scripts: LoopScripts) -> SubmitResult:
        """Admit a rollout iff it is fresh and bound to its lease; raises StaleRolloutError, TaskCancelled,
        BadRollout, NotTaskHolder (the last two change nothing). Durable in the bucket before it returns."""
        store = self.store
        known: set[str] = set()
        if submission.rejected_groups:  # the usual case, no rejected group: no round trip for the known reasons
            async with asyncio.timeout(ASYNC_CALL_TIMEOUT_S):  # the loop's client has no socket timeout
                known = set(await scripts.redis.hkeys(store.keys.rejected_reasons))
        values = self._values(submission, known)
        try:
            reply = await scripts.submit_rollout(**values)
        except RolloutTooStale as stale:
            await self.snapshots.wait_durable(store.mark_changed())
            raise self._stale(submission, stale) from None
        except UnknownTask:
            raise
        except TaskCancelled:
            store.mark_changed()  # its rollout went (back) under retention
            raise
        # Admitted (or admitted before; a duplicate may have put a finished rollout back under retention):
        # durable in the bucket before the worker hears so. Group commit: one put covers every submit that
        # arrived while the previous one was being written.
        await self.snapshots.wait_durable(store.mark_changed())
        return SubmitResult(status="admitted" if reply.code == "OK" else "duplicate")

    def _stale(self, submission: RolloutSubmission, stale: RolloutTooStale) -> StaleRolloutError:
        return StaleRolloutError(self.window_version(submission), stale.current, self.config.max_staleness)
