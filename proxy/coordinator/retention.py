"""Retention: delete adapter versions and rollout objects that can never be used again (invariant 3).

Versions: everything older than ``current - max_staleness - 1`` goes, except versions under a live lease or
awaiting their evaluation, every ``keep_every``-th version and the current one; versions newer than the
window (an upload in progress) are never touched. Rollouts: the scripts queue a rollout in
``rollout_retention`` once it can never be trained (again); its object goes
``async.rollout_retention_versions`` versions later (``-1`` keeps all).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from asyncgrpo.bucket import keys as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError
from asyncgrpo.bucket.manifest import delete_version, list_versions
from asyncgrpo.run.config import AsyncConfig
from proxy.coordinator.errors import SnapshotFailed
from proxy.coordinator.leases import live_leased_versions
from proxy.coordinator.redis_store import RedisStore
from proxy.coordinator.snapshot import SnapshotWriter

log = structlog.get_logger()

MAX_ROLLOUT_DELETES_PER_TICK = 256
"""Rollout objects deleted by one tick at most; the rest wait for the next (a tick must stay short)."""


def track_flag(async_config: AsyncConfig) -> str:
    """The scripts' ``track`` argument: "0" when ``rollout_retention_versions = -1`` keeps every rollout."""
    return "0" if async_config.rollout_retention_versions < 0 else "1"


class Retention:
    """Garbage collection of one run's versions and rollout objects."""

    def __init__(
        self,
        store: RedisStore,
        async_config: AsyncConfig,
        bucket: Bucket,
        snapshots: SnapshotWriter,
        protected: Callable[[], set[int]] | None = None,
    ) -> None:
        """``protected``: versions kept like leased ones (those awaiting their evaluation, ``evaluations``)."""
        self.store = store
        self.protected = protected or set
        self.config = async_config
        self.bucket = bucket
        self.snapshots = snapshots
        # (current version, leased versions) of the last collection: nothing to do until either changes
        self._last_gc: tuple[int, frozenset[int]] | None = None
        # whether the last collection kept an old version only for a live lease (then leases are read each tick)
        self._held_by_lease = False

    def forget_last_gc(self) -> None:
        """After a rebuild: collect at the next tick whatever the last collection saw."""
        self._last_gc = None

    def collect_versions(self) -> list[int]:
        """Delete versions older than ``current - max_staleness - 1`` that no live lease holds.

        Every ``keep_every``-th version and the current one are kept. Versions newer than the window (an
        upload in progress) are never touched. Runs when the current version changed, or when the last
        collection kept an old version for a live lease and the leased set changed; otherwise a tick reads no
        lease at all (reading them is O(workers), and nothing could be collected).
        """
        store = self.store
        current = store.current_version()
        if current < 0:
            return []
        if self._last_gc is not None and self._last_gc[0] == current and not self._held_by_lease:
            # Nothing can have become collectable: the window moves only with the current version, and no
            # old version waited for a lease to end. Skips reading every lease at every tick.
            return []
        leased = frozenset(live_leased_versions(store) | self.protected())
        if self._last_gc == (current, leased):
            return []
        cutoff = current - self.config.max_staleness - 1
        keep_every = self.config.keep_every
        deleted = []
        held = False
        for version in list_versions(self.bucket, store.run):
            if version >= cutoff or (keep_every and version % keep_every == 0):
                continue
            if version in leased:
                held = True
                continue
            delete_version(self.bucket, store.run, version)
            deleted.append(version)
        if deleted:
            store.count("versions_deleted", len(deleted))
            log.info("proxy.versions_collected", versions=deleted, current=current, leased=sorted(leased))
        self._last_gc = (current, leased)
        self._held_by_lease = held
        return deleted

    def collect_rollouts(self) -> list[str]:
        """Delete rollout objects whose retention is over; returns the task ids whose objects went.

        The scripts queue a rollout in ``rollout_retention`` once it can never be trained (again): trained in
        the step that produced version S (score S), or dropped as stale, rejected or cancelled (score: the
        current version then). Its object goes once ``current >= score + async.rollout_retention_versions``.
        Buffered and claimed rollouts are never queued, and DUE_ROLLOUTS checks that again, so invariant 4
        holds and a redelivered optimize task of an unpublished step finds its rollouts. A snapshot is written
        before anything is deleted, so a rebuild never resurrects a finished rollout as buffered or claimed.
        Deleting is idempotent; a failed delete stays queued for the next tick.
        """
        store = self.store
        retention = self.config.rollout_retention_versions
        current = store.current_version()
        if retention < 0 or current < 0:
            return []
        max_version = current - retention
        reply = store.scripts.due_rollouts(max_version=max_version, limit=MAX_ROLLOUT_DELETES_PER_TICK)
        due, protected = reply["due"], reply["protected"]
        if protected:
            # A bug elsewhere queued a rollout that may still be trained: never delete it.
            log.error("proxy.rollout_retention_skipped_needed", task_ids=protected)
            store.mark_changed()
        if not due:
            return []
        try:
            self.snapshots.write(force=True)
        except SnapshotFailed as error:
            log.warning("proxy.rollout_gc_postponed", error=str(error))
            return []
        deleted: list[str] = []
        for task_id in due:
            key = bucket_keys.rollout_key(store.run, task_id)
            try:
                self.bucket.delete(key)
            except (BucketError, OSError) as error:
                # The rest stay queued; the bucket is probably unreachable, so stop for this tick.
                log.warning("proxy.rollout_delete_failed", key=key, error=str(error))
                break
            deleted.append(task_id)
        if deleted:
            store.scripts.forget_rollouts(max_version=max_version, task_ids=deleted)
            store.mark_changed()
            log.info("proxy.rollouts_collected", count=len(deleted), current=current, retention=retention)
        return deleted
