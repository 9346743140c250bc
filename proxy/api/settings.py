"""The proxy's settings, from environment variables (prefix ``ASYNCGRPO_``), on the common base.

Everything about the run itself (staleness, buffer sizes, timeouts) is in the run config stored in the
bucket; only where to find things and how to serve them is set here.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field

from asyncgrpo.protocol.settings import CommonSettings, env_name

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class ProxySettings(CommonSettings):
    """The proxy process: the common settings plus where the API listens and how often it does housekeeping."""

    proxy_host: str = Field("127.0.0.1", min_length=1)
    """Address the HTTP API (and its `/metrics`, `/healthz`) listens on."""

    proxy_port: int = Field(8700, ge=1, le=65535)
    """Port the HTTP API listens on."""

    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=64 * 1024, le=1024**3)
    """Largest request body the API reads; a larger one is refused (413 `too_large`) before it is parsed.
    The workers' requests are a few KiB."""

    metrics_need_token: bool = False
    """Ask for the bearer token on `/metrics` too (it carries counts, no ids; Prometheus then needs
    `authorization: {credentials: ...}` in its scrape config)."""

    tick_s: float = Field(0.25, gt=0.0, le=60.0)
    """Seconds between housekeeping rounds (expire, dispatch, claim, GC, snapshot); a round also runs right
    after every submit and publish."""

    worker_alive_s: float = Field(15.0, gt=0.0, le=86400.0)
    """A worker counts as alive if it sent a heartbeat within this many seconds (3x the workers'
    `ASYNCGRPO_HEARTBEAT_S`); the task or step of a worker silent this long is re-sent at once."""

    proxy_standby: bool = False
    """Start as a stand-by: if another proxy holds the run's leadership, wait and take over when it lapses, instead
    of refusing to start (also `asyncgrpo proxy --standby`)."""

    proxy_leadership_ttl_s: float = Field(
        6.0,
        ge=1.0,
        le=600.0,
        # The variable's first name (before "lease" was kept for the workers' leases) still works: unit files have it.
        validation_alias=AliasChoices(env_name("proxy_leadership_ttl_s"), env_name("proxy_lease_ttl_s")),
    )
    """Seconds the proxy's leadership of its run lives unless renewed (renewed every third of it); a stand-by
    takes over this long after the live proxy stops. The former name `ASYNCGRPO_PROXY_LEASE_TTL_S` is read too."""

    allow_redis_eviction: bool = False
    """Start even if Redis's `maxmemory-policy` is not `noeviction` (evicted state keys lose admitted work)."""

    allow_unconditional_bucket: bool = False
    """Start even if the bucket ignores conditional writes (`If-None-Match: *`, `If-Match`): manifests are then
    write-once, and the snapshot fenced against a paused proxy, by convention only."""
