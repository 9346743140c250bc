"""Leases on adapter versions: a generate worker holds one while it samples, so the version is not collected.

A lease names the current version and expires ``async.lease_ttl_s`` after it was granted or last renewed
(Redis also gets a ``PEXPIRE`` as a backstop). Versions under a live lease are never deleted (invariant 3);
``tick()`` forgets the expired ones. The first lease on each version observes how long the version waited
between its publish and its first use.
"""

from __future__ import annotations

import uuid

import structlog

from asyncgrpo.bucket import keys as bucket_keys
from asyncgrpo.protocol.schemas import LeaseGrant
from asyncgrpo.run.config import AsyncConfig
from proxy.coordinator.metrics import ProxyMetrics
from proxy.coordinator.redis_store import RedisStore

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

    def grant(self, worker_id: str, task_id: str, incarnation: str = "") -> LeaseGrant:
        """Lease the current version for a task in flight; raises NoVersionYet before the init step published
        version 0, TaskEnded for a task of this run that is cancelled, done or forgotten."""
        lease_id = uuid.uuid4().hex
        now = self.store.clock_ms()
        reply = self.store.scripts.grant_lease(
            now_ms=now,
            ttl_ms=self._ttl_ms,
            lease_id=lease_id,
            worker_id=worker_id,
            task_id=task_id,
            task_prefix=task_id_prefix(self.store.run),
            incarnation=incarnation,
        )
        version = reply["version"]
        if version > self._first_use_marked:
            self._observe_first_use(version, now)
        return self._grant(lease_id, version, reply["manifest_sha256"], reply["expires_ms"])

    def _observe_first_use(self, version: int, now_ms: int) -> None:
        """At the first lease on ``version``, observe the seconds since it was published.

        The publish time is the ``published_ms`` that PUBLISH_VERSION writes, with the CAS, into the record
        of the step that made the version (step == version); that record expires ``record_ttl_s`` after the
        publish. The first lease is told apart by HSETNX on the same record, so it is counted once even
        across proxy restarts. A record without ``published_ms`` (expired, or Redis rebuilt) is left alone.
        """
        redis = self.store.redis
        step_key = self.store.keys.step(version)
        published_ms = redis.hget(step_key, "published_ms")
        if published_ms is None:
            self._first_use_marked = version
            return
        pipe = redis.pipeline(transaction=True)
        pipe.hsetnx(step_key, "first_lease_ms", now_ms)
        # Backstop: should the record have expired between the two calls, the stub HSETNX made expires too.
        pipe.expire(step_key, self.store.record_ttl_s, nx=True)
        first, _ = pipe.execute()
        self._first_use_marked = version
        if first:
            seconds = max(0, now_ms - int(published_ms)) / 1000.0
            self.metrics.version_first_use.observe(seconds)
            log.info("proxy.version_first_use", version=version, seconds=seconds)

    def renew(self, lease_id: str) -> LeaseGrant:
        """Push a live lease's expiry on; raises LeaseLostError if it already expired."""
        reply = self.store.scripts.renew_lease(now_ms=self.store.clock_ms(), ttl_ms=self._ttl_ms, lease_id=lease_id)
        return self._grant(lease_id, reply["version"], reply["manifest_sha256"], reply["expires_ms"])

    def release(self, lease_id: str) -> bool:
        """Drop a lease; False if it was already gone (releasing is idempotent)."""
        return bool(self.store.scripts.release_lease(lease_id=lease_id)["released"])

    def expire(self) -> int:
        """Forget the leases past their expiry; returns how many."""
        return self.store.scripts.expire_leases(now_ms=self.store.clock_ms())["expired"]
