"""Worker process settings, read once from the environment (systemd EnvironmentFile, Procfile, shell)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as error:
        raise ValueError(f"{name}={raw!r} is not a number; set it to seconds, e.g. {default}") from error


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as error:
        raise ValueError(f"{name}={raw!r} is not an integer") from error


@dataclass(frozen=True)
class WorkerSettings:
    redis_url: str = field(
        default_factory=lambda: os.environ.get("ASYNCGRPO_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    """Celery broker (the same Redis the proxy keeps its state in)."""
    proxy_url: str = field(default_factory=lambda: os.environ.get("ASYNCGRPO_PROXY_URL", "http://127.0.0.1:8700"))
    """Base URL of the run's proxy."""
    token: str | None = field(default_factory=lambda: os.environ.get("ASYNCGRPO_TOKEN") or None)
    """Bearer token shared with the proxy."""
    bucket_url: str = field(default_factory=lambda: os.environ.get("ASYNCGRPO_BUCKET", "file://work/bucket"))
    """file://PATH or s3://BUCKET/PREFIX; ASYNCGRPO_S3_ENDPOINT_URL selects an S3-compatible store."""
    worker_id: str = field(
        default_factory=lambda: os.environ.get("ASYNCGRPO_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}"
    )
    """Unique name of this worker process in heartbeats, leases, rollouts and metrics."""
    device: str = field(default_factory=lambda: os.environ.get("ASYNCGRPO_DEVICE", "auto"))
    """'auto' (cuda when available), 'cpu', 'cuda' or 'cuda:N'."""
    generation_backend: str | None = field(
        default_factory=lambda: os.environ.get("ASYNCGRPO_GENERATION_BACKEND") or None
    )
    """Overrides the run config's sampling.backend on this generate worker ('transformers' or 'vllm')."""
    cache_dir: Path = field(
        default_factory=lambda: Path(
            os.environ.get("ASYNCGRPO_CACHE", str(Path.home() / ".cache" / "asyncgrpo"))
        )
    )
    """Local cache of adapters and the tiny model."""
    visibility_timeout_s: float = field(
        default_factory=lambda: _env_float("ASYNCGRPO_VISIBILITY_TIMEOUT_S", 1800.0)
    )
    """Broker visibility timeout: must exceed the longest task; a killed worker's task returns after it."""
    restore_interval_s: float = field(default_factory=lambda: _env_float("ASYNCGRPO_RESTORE_INTERVAL_S", 2.0))
    """How often a worker sweeps for tasks of dead workers whose visibility timeout passed."""
    soft_shutdown_s: float = field(default_factory=lambda: _env_float("ASYNCGRPO_SOFT_SHUTDOWN_S", 20.0))
    """On SIGTERM, how long a busy worker may finish its task before handing it back."""
    heartbeat_s: float = field(default_factory=lambda: _env_float("ASYNCGRPO_HEARTBEAT_S", 5.0))
    """Seconds between heartbeats to the proxy."""
    metrics_port: int | None = field(default_factory=lambda: _env_int("ASYNCGRPO_METRICS_PORT", None))
    """Prometheus port of this worker process (unset: no endpoint)."""


def load_worker_settings() -> WorkerSettings:
    return WorkerSettings()
