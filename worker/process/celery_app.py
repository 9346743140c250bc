"""The Celery application every worker process runs, configured for preemptible machines.

Why each setting, for workers on preemptible machines:
- JSON only: nothing but JSON crosses the broker (no pickle).
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a task is acknowledged only once done, so a worker
  killed mid-task leaves it unacked and it is delivered again; tasks are idempotent for that reason.
- ``worker_prefetch_multiplier = 1``: a busy worker never holds a second task that an idle one could run.
- visibility timeout above the longest task, with kombu's unacked-restore sweep every couple of seconds
  (interval lowered, throttle 1), so a kill -9'd worker's task comes back soon after the timeout rather
  than a ~100 s sweep later.
- SIGTERM: a preempted worker gets a short grace period (ASYNCGRPO_SOFT_SHUTDOWN_S), then hands its task
  back to the queue (``worker.process.tasks``; Celery's own cold shutdown cannot stop a solo-pool task).
- solo pool (set by the launcher): a forked child hangs on torch once its parent has run a torch op.
- one run per worker (``ASYNCGRPO_RUN``): its tasks are routed to that run's queues
  (``asyncgrpo.protocol.schemas``), and remote control (``celery inspect``, mingle, gossip) goes over a control
  exchange of the run's own, so runs sharing one Redis neither take each other's tasks nor answer each other's
  ``celery inspect``. A worker process (``ASYNCGRPO_WORKER_ROLE`` set by the launcher) without a run does not
  start; a client without one (``celery inspect`` with ASYNCGRPO_RUN unset) reaches no asyncgrpo worker.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from asyncgrpo.protocol.schemas import (
    GENERATE_TASK_NAME,
    OPTIMIZE_TASK_NAME,
    generate_queue,
    optimize_queue,
    run_queue_prefix,
)
from worker.process.settings import process_settings


def control_exchange(run: str) -> str:
    """The remote-control exchange of ``run``'s workers and of the `celery inspect` client that asks them."""
    return run_queue_prefix(run) + "control"


def run_routing(run: str) -> dict[str, Any]:
    """The Celery settings that bind an app to ``run``: its tasks' queues and its control exchange."""
    return {
        "task_routes": {
            GENERATE_TASK_NAME: {"queue": generate_queue(run)},
            OPTIMIZE_TASK_NAME: {"queue": optimize_queue(run)},
        },
        "task_default_queue": generate_queue(run),
        "control_exchange": control_exchange(run),
    }


class WorkerApp(Celery):
    """The Celery app, which also keeps what its worker process built once: the runtime
    (``worker.process.runtime.get_runtime``), on the process's own object rather than a module global."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runtime: Any = None  # a worker.process.runtime.WorkerRuntime once the first task or signal built it


def build_celery_app() -> WorkerApp:
    settings = process_settings()
    # A worker process must know its run (SettingsError naming ASYNCGRPO_RUN otherwise); a client may not.
    needs_run = settings.worker_role is not None or settings.run is not None
    run = settings.require_run() if needs_run else None
    # The worker imports these at start: the tasks, and the custom inspect commands it answers. The `celery
    # inspect` client side loads the commands through `-A worker.process.inspect_commands`, which imports this.
    celery = WorkerApp(
        "asyncgrpo", broker=settings.redis_url, include=["worker.process.tasks", "worker.process.inspect_commands"]
    )
    celery.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        event_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        worker_pool="solo",
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            "unacked_restore_interval": settings.restore_interval_s,
            "unacked_restore_throttle": 1,
        },
    )
    if run is not None:
        celery.conf.update(run_routing(run))
    return celery


app = build_celery_app()
