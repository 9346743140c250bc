"""What ``serve()`` checks before it coordinates a run, and the loop that keeps its leadership.

Start-up checks (each refused with what to change, unless a setting allows it; see docs/operations.md):

- Redis ``maxmemory-policy`` must be ``noeviction``: an evicted key of the run's state loses admitted work
  (``ASYNCGRPO_ALLOW_REDIS_EVICTION=1`` starts anyway). Where ``CONFIG`` is disabled (some managed Redis),
  the proxy warns and goes on.
- The bucket must honour create-only writes: a throwaway key under the run's prefix is put twice with
  ``if_absent``; the second put must be refused (``ASYNCGRPO_ALLOW_UNCONDITIONAL_BUCKET=1`` starts anyway).
- The run's proxy lease (``proxy.coordinator.leadership``): taken with an epoch above the snapshot's; held
  by another proxy, start-up is refused, or a stand-by waits for it.

Once serving, ``keep_leadership`` renews the lease every third of its TTL. A proxy that finds it taken stops
coordinating at once: state-changing requests are refused (503), and the process stops itself (SIGTERM to
itself, then ``serve`` exits non-zero) so that systemd restarts it, as a stand-by if so configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from fastapi import Request, Response
from redis import Redis
from redis.exceptions import RedisError, ResponseError

from asyncgrpo.bucket import keys as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectExists, ObjectNotFound
from proxy.api.settings import ProxySettings
from proxy.coordinator.leadership import FenceLost, LeadershipHeld, ProxyFence
from proxy.coordinator.snapshot import snapshot_epoch

log = structlog.get_logger()


class ProxyStartupError(Exception):
    """The proxy cannot start as configured; the message says what to change."""


def check_eviction_policy(redis: Redis, *, allow: bool) -> str | None:
    """Refuse a Redis that may evict the run's keys; returns the policy (None if CONFIG is disabled)."""
    try:
        reply = redis.config_get("maxmemory-policy")
    except ResponseError as error:
        log.warning(
            "proxy.redis_config_unavailable",
            error=str(error),
            hint="cannot check maxmemory-policy; make sure the Redis service is set to noeviction",
        )
        return None
    policy = str(reply.get("maxmemory-policy", "noeviction"))
    if policy != "noeviction":
        message = (
            f"Redis runs with maxmemory-policy {policy!r}: under memory pressure it evicts keys of the run's "
            "state and admitted work is lost. Set `maxmemory-policy noeviction` (redis.conf, or CONFIG SET), or "
            "set ASYNCGRPO_ALLOW_REDIS_EVICTION=1 to start anyway"
        )
        if not allow:
            raise ProxyStartupError(message)
        log.warning("proxy.redis_eviction_allowed", policy=policy)
    return policy


def check_conditional_writes(bucket: Bucket, run: str, *, allow: bool) -> bool:
    """Probe create-only writes with a throwaway key under the run's prefix; True if the store honours them."""
    key = bucket_keys.proxy_probe_key(run, uuid.uuid4().hex)
    try:
        bucket.put(key, b"probe", if_absent=True)
        try:
            bucket.put(key, b"probe again", if_absent=True)
            honoured = False
        except ObjectExists:
            honoured = True
    finally:
        bucket.delete(key)
    if not honoured:
        message = (
            f"the bucket {bucket.url} ignores create-only writes (a second put of {key} with If-None-Match: * "
            "succeeded): two trainers could overwrite one version's manifest. Use a store that honours "
            "conditional writes (AWS S3, SeaweedFS, MinIO recent), or set ASYNCGRPO_ALLOW_UNCONDITIONAL_BUCKET=1 "
            "to start anyway"
        )
        if not allow:
            raise ProxyStartupError(message)
        log.warning("proxy.unconditional_bucket_allowed", bucket=bucket.url)
    return honoured


def take_leadership(
    fence: ProxyFence, bucket: Bucket, *, standby: bool, sleep: Callable[[float], object] = time.sleep
) -> int:
    """Take the run's proxy lease with an epoch above the bucket snapshot's; returns the epoch. Held by
    another proxy: refuse (``ProxyStartupError``), or with ``standby`` wait until it lapses."""
    with contextlib.suppress(ObjectNotFound):
        fence.raise_floor(snapshot_epoch(bucket.get(bucket_keys.proxy_snapshot_key(fence.run))))
    announced = False
    while True:
        try:
            return fence.acquire()
        except LeadershipHeld as error:
            if not standby:
                raise ProxyStartupError(str(error)) from error
            if not announced:
                log.warning("proxy.standby_waiting", run=fence.run, holder=error.holder.describe())
                announced = True
        sleep(fence.renew_every_s)


async def keep_leadership(fence: ProxyFence, stop: Callable[[], object]) -> None:
    """Renew the lease every third of its TTL until it is lost; then call ``stop`` once and return."""
    while True:
        try:
            await asyncio.to_thread(fence.confirm)
        except FenceLost as error:
            log.critical("proxy.stopping_lease_lost", run=fence.run, error=str(error))
            stop()
            return
        except RedisError as error:  # Redis away: nobody else can take the lease either; retry
            log.warning("proxy.lease_renew_failed", run=fence.run, error=str(error))
        await asyncio.sleep(fence.renew_every_s)


def stop_this_process() -> None:
    """Ask uvicorn to shut down as on SIGTERM; ``serve`` then exits non-zero since the lease is lost."""
    os.kill(os.getpid(), signal.SIGTERM)


def start_checks(redis: Redis, bucket: Bucket, run: str, settings: ProxySettings, *, standby: bool) -> ProxyFence:
    """Every start-up check, then the run's lease (waiting for it if ``standby``); raises
    ``ProxyStartupError`` with what to change."""
    check_eviction_policy(redis, allow=settings.allow_redis_eviction)
    check_conditional_writes(bucket, run, allow=settings.allow_unconditional_bucket)
    fence = ProxyFence(redis, run, ttl_s=settings.proxy_lease_ttl_s)
    take_leadership(fence, bucket, standby=standby or settings.proxy_standby)
    return fence


CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def leadership_guard(fence: ProxyFence | None, refuse: Callable[[str], Response]) -> Callable[..., Any]:
    """An HTTP middleware: once the lease is lost, every state-changing request is refused (``refuse``)."""

    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        # Only the methods of state-changing routes: any other one is routed on, to be answered 405 or 404.
        if fence is not None and fence.lost is not None and request.method in CHANGING_METHODS:
            return refuse(f"this proxy lost the run's lease to {fence.lost.describe()}; retry shortly")
        return await call_next(request)

    return guard
