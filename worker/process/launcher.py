"""``asyncgrpo worker generate|optimize``: start ``celery worker`` with the queues, pool and flags a role needs.

The queues are those of the run named by ``ASYNCGRPO_RUN`` (``asyncgrpo.protocol.schemas``); without it the worker
does not start.

``asyncgrpo worker optimize --nproc-per-node N`` (N > 1) starts one optimize worker over N local GPUs: it
replaces itself with ``torch.distributed.run``, which starts the same command (``python -m worker optimize``)
once per rank. Rank 0 becomes the Celery worker (the leader); every other rank becomes a follower
(``follow_leader``), which takes part in the leader's trainer calls and talks to nothing else
(``worker.optimize.ranks``). When one rank exits, the launcher stops the others and exits non-zero, and the unit
restarts the whole worker.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import get_args

from asyncgrpo.protocol.schemas import worker_queues
from asyncgrpo.protocol.settings import SettingsError
from worker.process.settings import RankSettings, WorkerRole, load_worker_settings

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


def ranks_argv(nproc_per_node: int, extra_args: list[str]) -> list[str]:
    """``torch.distributed.run`` starting ``python -m worker optimize`` (the same command as ``asyncgrpo worker
    optimize``, by module so that the worker need not name the CLI above it) on ``nproc_per_node`` local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # one machine: a private rendezvous on a free port
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc_per_node),
        "--max-restarts",
        "0",  # a rank that dies ends the whole worker; its unit restarts it from the bucket
        "--monitor-interval",
        "0.5",
        "-m",
        "worker",
        "optimize",
        *extra_args,
    ]


def follow_leader() -> int:
    """A follower rank's process: join the ranks and run the leader's trainer calls until it stops."""
    from asyncgrpo.protocol.log_setup import configure_logging
    from asyncgrpo.run.config import RunConfig
    from worker.optimize.ranks import follow
    from worker.process.runtime import build_trainer, join_ranks

    settings = load_worker_settings()
    configure_logging(
        log_format=settings.log_format, level=settings.log_level, role="optimize", worker=settings.worker_id
    )
    # A stop (systemctl stop, a spot reclaim) reaches every rank; the leader decides when the step is handed
    # back and then lets the followers go, so they must outlive its grace period.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if settings.torch_threads is not None:
        import torch

        torch.set_num_threads(settings.torch_threads)
    ranks = join_ranks(settings)
    return follow(ranks, lambda config: build_trainer(RunConfig.model_validate_json(config), settings, ranks))


def run_worker(role: str, extra_args: list[str], nproc_per_node: int = 1) -> int:
    """Replace this process with the celery worker (so systemd's signals reach it directly); with
    ``nproc_per_node`` > 1, with the launcher of that many ranks."""
    # Read (and checked) here, so a bad variable fails before Celery starts, with a message naming it.
    settings = load_worker_settings()
    if nproc_per_node > 1:
        if role != "optimize":
            raise SettingsError(f"--nproc-per-node {nproc_per_node} is for optimize workers; a {role} worker has one")
        settings.require_run()
        argv = ranks_argv(nproc_per_node, extra_args)
        os.execvpe(argv[0], argv, dict(os.environ))
    if RankSettings().rank > 0:
        return follow_leader()
    argv = celery_worker_argv(role, settings.require_run(), settings.worker_id, extra_args, settings.celery_loglevel)
    env = dict(os.environ)
    # SIGTERM (spot preemption, systemctl stop) is handled by worker.process.tasks: a short grace period, then
    # the running task goes back to the queue.
    env[ROLE_ENV] = role
    os.execvpe(argv[0], argv, env)
    return 0  # not reached: execvpe replaces the process
