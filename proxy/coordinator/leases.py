"""Leases on adapter versions, and retention: what no lease holds is collected from the bucket.

Leases: a generate worker holds one while it samples, so the version is not collected.

A lease names the current version and expires ``async.lease_ttl_s`` after it was granted or last renewed
(Redis also gets a ``PEXPIRE`` as a backstop). Versions under a live lease are never deleted (invariant 3);
``tick()`` forgets the expired ones. The first lease on each version observes how long the version waited
between its publish and its first use.

Retention (invariant 3): versions older than ``current - max_staleness - 1`` go, except versions under a live
lease or awaiting their evaluation, every ``keep_every``-th version and the current one; versions newer than
the window (an upload in progress) are never touched. Rollouts: the scripts queue a rollout in
``rollout_retention`` once it can never be trained (again); its object goes
``async.rollout_retention_versions`` versions later (``-1`` keeps all).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import structlog
from redis.exceptions import RedisError

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError
from asyncgrpo.bucket.layout import delete_version, list_versions
from asyncgrpo.protocol.schemas import LeaseGrant
from asyncgrpo.run.config import AsyncConfig
from proxy.coordinator.metrics import ProxyMetrics
from proxy.coordinator.redis_store import LoopScripts, RedisStore
from proxy.coordinator.scripts import SnapshotFailed
from proxy.coordinator.snapshot import SnapshotWriter

log = structlog.get_logger()


def task_id_prefix(run: str) -> str:
    """How every generate task id of ``run`` starts (``lua/dispatch_generate.lua`` makes them)."""
    return f"gen-{run}-"


def live_leased_versions(store: RedisStore) -> set[int]:
    """The versions some unexpired lease names."""
    now = store.clock_ms()
    lease_ids = store.redis.zrangebyscore(store.keys.leases, f"({now}", "+inf")
    if not lease_ids:
        return set()
    pipe = store.redis.pipeline(transaction=False)
    for lease_id in lease_ids:
        pipe.hget(store.keys.lease(lease_id), "version")
    return {int(v) for v in pipe.execute() if v is not None}


class Leases:
    """Grant, renew, release and expire the leases of one run."""

    def __init__(self, store: RedisStore, async_config: AsyncConfig, metrics: ProxyMetrics) -> None:
        self.store = store
        self.config = async_config
        self.metrics = metrics
        # Highest version whose first lease this process has seen marked in Redis (saves a round trip).
        self._first_use_marked = -1

    @property
    def _ttl_ms(self) -> int:
        return int(self.config.lease_ttl_s * 1000)

    def _grant(self, lease_id: str, version: int, sha: str | None, expires_ms: int) -> LeaseGrant:
        run = self.store.run
        return LeaseGrant(
            lease_id=lease_id,
            version=version,
            adapter_prefix=bucket_keys.adapter_prefix(run, version),
            manifest_key=bucket_keys.manifest_key(run, version),
            manifest_sha256=sha or "",
            ttl_s=self.config.lease_ttl_s,
            expires_at=expires_ms / 1000.0,
        )

    async def grant(self, worker_id: str, task_id: str, incarnation: str, scripts: LoopScripts) -> LeaseGrant:
        """Lease the current version for a task in flight; raises NoVersionYet before the init step published
        version 0, TaskEnded for a task of this run that is cancelled, done or forgotten. The first lease of a
        version (once per version) observes its wait in a thread: it takes two more round trips."""
        lease_id, now, values = self._grant_values(worker_id, task_id, incarnation)
        reply = await scripts.grant_lease(**values)
        if reply["version"] > self._first_use_marked:
            await asyncio.to_thread(self._observe_first_use, reply["version"], now)
        return self._grant(lease_id, reply["version"], reply["manifest_sha256"], reply["expires_ms"])

    def _grant_values(self, worker_id: str, task_id: str, incarnation: str) -> tuple[str, int, dict[str, Any]]:
        lease_id = uuid.uuid4().hex
        now = self.store.clock_ms()
        values = {
            "now_ms": now,
            "ttl_ms": self._ttl_ms,
            "lease_id": lease_id,
            "worker_id": worker_id,
            "task_id": task_id,
            "task_prefix": task_id_prefix(self.store.run),
            "incarnation": incarnation,
        }
        return lease_id, now, values

    def _observe_first_use(self, version: int, now_ms: int) -> None:
        """At the first lease on ``version``, observe the seconds since it was published.

        The publish time is the ``published_ms`` that PUBLISH_VERSION writes, with the CAS, into the record
        of the step that made the version (step == version); that record expires ``record_ttl_s`` after the
        publish. The first lease is told apart by HSETNX on the same record, so it is counted once even
        across proxy restarts. A record without ``published_ms`` (expired, or Redis rebuilt) is left alone.
        """
        redis = self.store.redis
        step_key = self.store.keys.step(version)
        try:
            published_ms = redis.hget(step_key, "published_ms")
            if published_ms is None:
                self._first_use_marked = version
                return
            pipe = redis.pipeline(transaction=True)
            pipe.hsetnx(step_key, "first_lease_ms", now_ms)
            # Backstop: should the record have expired between the two calls, the stub HSETNX made expires too.
            pipe.expire(step_key, self.store.record_ttl_s, nx=True)
            first, _ = pipe.execute()
        except RedisError as error:
            # The lease is granted already: failing its answer now would only make the worker lease again.
            # The next lease of the version observes it instead.
            log.warning("proxy.version_first_use_unobserved", version=version, error=str(error))
            return
        self._first_use_marked = version
        if first:
            seconds = max(0, now_ms - int(published_ms)) / 1000.0
            self.metrics.version_first_use.observe(seconds)
            log.info("proxy.version_first_use", version=version, seconds=seconds)

    async def renew(self, lease_id: str, scripts: LoopScripts) -> LeaseGrant:
        """Push a live lease's expiry on; raises LeaseLostError if it already expired."""
        reply = await scripts.renew_lease(now_ms=self.store.clock_ms(), ttl_ms=self._ttl_ms, lease_id=lease_id)
        return self._grant(lease_id, reply["version"], reply["manifest_sha256"], reply["expires_ms"])

    async def release(self, lease_id: str, scripts: LoopScripts, *, ends_hold: bool) -> bool:
        """Drop a lease; False if it was already gone (releasing is idempotent). ``ends_hold``: the worker's own
        release, which also ends its hold on the task (a submission's release keeps it)."""
        reply = await scripts.release_lease(lease_id=lease_id, ends_hold="1" if ends_hold else "0")
        return bool(reply["released"])

    def expire(self) -> int:
        """Forget the leases past their expiry; returns how many."""
        return self.store.scripts.expire_leases(now_ms=self.store.clock_ms())["expired"]


# ---- retention: what no lease, window or evaluation holds is deleted ----
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
        """``protected``: versions kept like leased ones (those awaiting their evaluation, ``evals``)."""
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

    def tick(self) -> tuple[list[int], list[str]]:
        """Housekeeping's part here: the versions and the rollout objects collected. A bucket that fails the
        versions' listing or deletes is logged and tried again next tick; the rollouts' go on meanwhile."""
        try:
            versions = self.collect_versions()
        except (BucketError, OSError) as error:
            log.warning("proxy.gc_failed", error=str(error))
            versions = []
        return versions, self.collect_rollouts()

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
        # One request per thousand keys on S3 (DeleteObjects): a delete each was a tenth of the proxy's CPU at
        # a thousand generate workers (``benchmarks/bench_fleet.py --py-spy``).
        keys = [bucket_keys.rollout_key(store.run, task_id) for task_id in due]
        try:
            self.bucket.delete_keys(keys)
            deleted = list(due)
        except (BucketError, OSError) as error:
            # All stay queued (deleting is idempotent); the bucket is probably unreachable: next tick.
            log.warning("proxy.rollout_delete_failed", first_key=keys[0], count=len(keys), error=str(error))
            deleted = []
        if deleted:
            store.scripts.forget_rollouts(max_version=max_version, task_ids=deleted)
            store.mark_changed()
            log.info("proxy.rollouts_collected", count=len(deleted), current=current, retention=retention)
        return deleted
