"""``asyncgrpo worker generate|optimize``: start ``celery worker`` with the queues, pool and flags a role needs.

The queues are those of the run named by ``ASYNCGRPO_RUN`` (``asyncgrpo.protocol.schemas``); without it the worker
does not start.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import get_args

from asyncgrpo.protocol.schemas import worker_queues
from worker.process.settings import WorkerRole, load_worker_settings

ROLES: tuple[str, ...] = get_args(WorkerRole)
# WorkerSettings.worker_role: how the Celery child (tasks, inspect commands) learns its role.
ROLE_ENV = "ASYNCGRPO_WORKER_ROLE"


def celery_worker_argv(
    role: str, run: str, worker_id: str, extra_args: list[str], celery_loglevel: str = "INFO"
) -> list[str]:
    if role not in ROLES:
        raise ValueError(f"worker role {role!r} is unknown; use one of {', '.join(ROLES)}")
    # A unique node name per process so several workers on one machine can be told apart by `celery inspect`.
    node_name = f"{role}-{os.getpid()}@{socket.gethostname()}"
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "worker.process.celery_app",
        "worker",
        "--queues",
        # Only its run's queues; an optimize worker also its own: steps routed to the trainer holding their base.
        ",".join(worker_queues(run, role, worker_id)),
        "--pool",
        "solo",
        "--concurrency",
        "1",
        "--prefetch-multiplier",
        "1",
        "--hostname",
        node_name,
        "--loglevel",
        celery_loglevel,
        *extra_args,
    ]


def run_worker(role: str, extra_args: list[str]) -> int:
    """Replace this process with the celery worker (so systemd's signals reach it directly)."""
    # Read (and checked) here, so a bad variable fails before Celery starts, with a message naming it.
    settings = load_worker_settings()
    argv = celery_worker_argv(role, settings.require_run(), settings.worker_id, extra_args, settings.celery_loglevel)
    env = dict(os.environ)
    # SIGTERM (spot preemption, systemctl stop) is handled by worker.process.tasks: a short grace period, then
    # the running task goes back to the queue.
    env[ROLE_ENV] = role
    os.execvpe(argv[0], argv, env)
    return 0  # not reached: execvpe replaces the process
