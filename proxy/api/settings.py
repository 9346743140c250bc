"""The proxy's settings, from environment variables (prefix ``ASYNCGRPO_``).

Everything about the run itself (staleness, buffer sizes, timeouts) is in the run config stored in the
bucket; only where to find things and how to serve them is set here.
"""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ProxySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASYNCGRPO_", extra="ignore", use_attribute_docstrings=True)

    redis_url: str = "redis://127.0.0.1:6379/0"
    """ASYNCGRPO_REDIS_URL: Redis holding the coordinator's state; also the Celery broker the proxy sends
    generate and optimize tasks to."""

    bucket: str | None = None
    """ASYNCGRPO_BUCKET: where the run lives, ``file:///abs/path`` or ``s3://bucket/prefix`` (S3 endpoint
    from ASYNCGRPO_S3_ENDPOINT_URL and the standard AWS credential chain)."""

    token: SecretStr | None = None
    """ASYNCGRPO_TOKEN: bearer token required on every POST/DELETE. The proxy refuses to start without one
    unless --insecure-loopback is given with a loopback host."""

    run: str | None = None
    """ASYNCGRPO_RUN: the run to coordinate (the CLI's --run overrides it)."""

    proxy_host: str = "127.0.0.1"
    """ASYNCGRPO_PROXY_HOST: address the HTTP API listens on."""

    proxy_port: int = Field(8700, ge=1, le=65535)
    """ASYNCGRPO_PROXY_PORT: port the HTTP API listens on."""

    tick_s: float = Field(0.25, gt=0.0, le=60.0)
    """ASYNCGRPO_TICK_S: seconds between housekeeping rounds (expire, dispatch, claim, GC, snapshot); a
    round also runs right after every submit and publish."""

    worker_alive_s: float = Field(30.0, gt=0.0, le=86400.0)
    """ASYNCGRPO_WORKER_ALIVE_S: a worker counts as alive if it sent a heartbeat within this many seconds
    (about 3x the workers' heartbeat interval)."""
