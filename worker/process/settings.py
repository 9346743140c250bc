"""Worker process settings, read once from the environment (systemd EnvironmentFile, Procfile, shell).

``WorkerSettings`` is the common base (Redis, bucket, token, logging), the local cache, the generate side's
section (``worker.generate.settings``) and what only worker processes need. Every variable keeps the name
and default it had when this was a hand-parsed dataclass.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from asyncgrpo.protocol.schemas import ID_PATTERN, check_queue_run
from asyncgrpo.protocol.settings import CacheSettings, CommonSettings, SettingsError, env_name
from worker.generate.settings import GenerateSettings

WorkerRole = Literal["generate", "optimize"]


def _hostname_pid() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(CommonSettings, CacheSettings, GenerateSettings):
    """A generate or optimize worker process (and the ``asyncgrpo worker`` launcher that starts it)."""

    bucket: str = Field("file://work/bucket", pattern=r"^(file|s3)://")
    """The run's bucket: `file:///abs/path` or `s3://bucket/prefix`."""

    proxy_url: str = Field("http://127.0.0.1:8700", pattern=r"^https?://")
    """Base URL of the run's proxy, as the workers reach it."""

    worker_id: str = Field(
        default_factory=_hostname_pid, pattern=ID_PATTERN, json_schema_extra={"shown_default": "<hostname>-<pid>"}
    )
    """Unique name of this worker process in heartbeats, leases, rollouts, metrics and its own queue's name."""

    worker_role: WorkerRole | None = None
    """Set by `asyncgrpo worker generate|optimize` for the Celery process it starts; never set it yourself."""

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Device of the model: `auto` (CUDA when present), `cpu`, `cuda` or `cuda:N`."""

    torch_threads: int | None = Field(None, ge=1, le=1024)
    """CPU threads torch uses in this worker (unset: torch's default, every core). Workers sharing a machine
    should split its cores between them, e.g. 1 each for a generate and an optimize worker on 2 cores:
    oversubscribed cores make both roles slower than one."""

    rank_timeout_s: float = Field(300.0, gt=0.0, le=86400.0)
    """Multi-GPU optimize workers (`--nproc-per-node N`): seconds one collective between the worker's ranks may
    wait inside a step before the step fails and the worker restarts (a hung rank). A rank that dies is noticed
    at once; waiting for the next step has no limit."""

    visibility_timeout_s: float = Field(1800.0, gt=0.0)
    """Broker visibility timeout in seconds: must exceed the longest task; a killed worker's task comes back
    after it."""

    restore_interval_s: float = Field(2.0, gt=0.0)
    """How often (s) a worker sweeps for tasks of dead workers whose visibility timeout passed."""

    soft_shutdown_s: float = Field(20.0, ge=0.0)
    """On SIGTERM, how long (s) a busy worker may finish its task before handing it back to the queue."""

    heartbeat_s: float = Field(5.0, gt=0.0, le=3600.0)
    """Seconds between heartbeats to the proxy."""

    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Prometheus port of this worker process (unset: no endpoint)."""

    upload_pause_s: float = Field(0.0, ge=0.0, le=600.0)
    """Test hook: seconds an optimize worker sleeps after each file of a version it uploads (files then go
    one at a time), so a test can pause it mid-upload. Leave it at 0."""

    celery_loglevel: str = Field("INFO", pattern=r"(?i)^(debug|info|warning|error|critical)$")
    """Log level of Celery's own worker lines."""

    def require_run(self) -> str:
        """The run whose queues this worker consumes; SettingsError naming ``ASYNCGRPO_RUN`` when it is unset or
        cannot name a queue (a worker serves exactly one run, so runs can share one Redis)."""
        name = env_name("run")
        if self.run is None:
            raise SettingsError(
                f"{name} is not set: a worker consumes the Celery queues of one run. Set {name} to the run's "
                "name (the one its proxy coordinates, `asyncgrpo proxy --run NAME`)."
            )
        try:
            return check_queue_run(self.run)
        except ValueError as error:
            raise SettingsError(f"{name}={self.run!r} is invalid: {error}. Set {name} to the run's name.") from None


class RankSettings(BaseSettings):
    """This process's place among the ranks of a multi-GPU optimize worker: the variables
    ``torch.distributed.run`` sets for each rank it starts (unset: a worker of one rank)."""

    model_config = SettingsConfigDict(env_prefix="", extra="ignore", frozen=True)

    rank: int = Field(0, ge=0)
    local_rank: int = Field(0, ge=0)
    world_size: int = Field(1, ge=1)


def load_worker_settings() -> WorkerSettings:
    return WorkerSettings()


@functools.cache
def process_settings() -> WorkerSettings:
    """This worker process's settings: parsed once, when the Celery app is built (the process's entry), and the
    same object for the runtime, the tasks and the inspect commands after it."""
    return load_worker_settings()
