"""Preemption: a SIGTERM (spot reclaim, ``systemctl stop``) hands the running task back to the queue.

Celery's own cold shutdown cannot stop a task in the solo pool (the solo pool has no ``kill_job``; the task
fails with NotImplementedError, is acknowledged, and its prompts wait for the proxy's timeout). So a worker
handles SIGTERM itself:

1. it stops taking tasks at once (Celery's warm-shutdown flag);
2. a running task gets ``ASYNCGRPO_SOFT_SHUTDOWN_S`` seconds to finish (a SIGALRM timer);
3. past that, ``WorkerPreempted`` is raised inside the task, which the task wrapper turns into
   ``Reject(requeue=True)``: the message goes straight back to its queue, where another worker takes it
   without waiting for the broker's visibility timeout. Every task is idempotent by id, so that worker
   simply does it again.

Signals are delivered to the main thread, which is where a solo worker runs its task, so the exception
lands in the task's own stack.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import structlog
from celery.worker import state as worker_state

log = structlog.get_logger()


class WorkerPreempted(BaseException):
    """Raised inside a running task when the worker was told to stop and the grace period is over."""


_grace_s = 0.0
_task_running = False


def install(grace_s: float) -> None:
    """Take over SIGTERM for this worker process (call from the main thread once the worker is ready)."""
    global _grace_s
    _grace_s = max(0.0, grace_s)
    signal.signal(signal.SIGTERM, _on_terminate)
    signal.signal(signal.SIGALRM, _on_grace_over)


@contextmanager
def task_running() -> Iterator[None]:
    """Marks the block as the running task: the one a SIGTERM hands back."""
    global _task_running
    _task_running = True
    try:
        yield
    finally:
        _task_running = False
        signal.setitimer(signal.ITIMER_REAL, 0)  # the task ended within its grace period


def _on_terminate(signum: int, _frame: FrameType | None) -> None:
    worker_state.should_stop = 0  # warm shutdown: no new task; Celery exits after the current one
    if not _task_running:
        log.warning("worker.stopping", signal=signum)
        return
    log.warning("worker.stopping_after_grace", signal=signum, grace_s=_grace_s)
    if _grace_s <= 0:
        raise WorkerPreempted(f"signal {signum}")
    signal.setitimer(signal.ITIMER_REAL, _grace_s)


def _on_grace_over(_signum: int, _frame: FrameType | None) -> None:
    if _task_running:
        raise WorkerPreempted(f"grace period of {_grace_s} s over")
