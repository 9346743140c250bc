"""Preemption: a SIGTERM (spot reclaim, ``systemctl stop``) hands the running task back to the queue.

Celery's own cold shutdown cannot stop a task in the solo pool (the solo pool has no ``kill_job``; the task
fails with NotImplementedError, is acknowledged, and its prompts wait for the proxy's timeout). So a worker
handles SIGTERM itself:

1. it stops taking tasks at once (Celery's warm-shutdown flag);
2. a running task gets ``ASYNCGRPO_SOFT_SHUTDOWN_S`` seconds to finish (a SIGALRM timer);
3. past that, ``WorkerPreempted`` is raised inside the task, which the task wrapper (``worker.process.tasks``)
   turns into ``Reject(requeue=True)``: the message goes straight back to its queue, where another worker takes
   it without waiting for the broker's visibility timeout. Every task is idempotent by id, so that worker
   simply does it again.

A generate task that saves partial sequences (``async.partial_rollouts``) stops by itself while it samples:
it reads ``stop.requested`` (a ``worker.generate.partial.StopRequest``) at every decode step, saves what it
has sampled and hands itself back (``worker.generate.partial.Interrupted``), so nothing sampled is lost. Inside
``stop.cooperating()`` a SIGTERM only asks it to; the timer still fires, after at least
``COOPERATIVE_GRACE_S``, should the task not stop.

Signals are delivered to the main thread, which is where a solo worker runs its task, so the exception
lands in the task's own stack. The state (grace period, whether a task runs) is a ``Preemption`` the worker's
runtime owns, one per process.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import structlog
from celery.worker import state as worker_state

from worker.generate.partial import StopRequest

log = structlog.get_logger()


COOPERATIVE_GRACE_S = 10.0
"""The least time a task that stops by itself gets before it is interrupted: a decode step and one small
bucket write per prompt group fit in it many times over."""


class WorkerPreempted(BaseException):
    """Raised inside a running task when the worker was told to stop and the grace period is over."""


class Preemption:
    """This process's SIGTERM handling: the grace period, and whether a task is running to hand back."""

    def __init__(self) -> None:
        self.grace_s = 0.0
        self.task_running = False
        self.stop = StopRequest()  # what the running task is asked, and whether it stops by itself

    def install(self, grace_s: float) -> None:
        """Take over SIGTERM for this worker process (call from the main thread once the worker is ready)."""
        self.grace_s = max(0.0, grace_s)
        signal.signal(signal.SIGTERM, self._on_terminate)
        signal.signal(signal.SIGALRM, self._on_grace_over)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Marks the block as the running task: the one a SIGTERM hands back."""
        self.task_running = True
        try:
            yield
        finally:
            self.task_running = False
            self.stop.requested = False
            signal.setitimer(signal.ITIMER_REAL, 0)  # the task ended within its grace period

    def _on_terminate(self, signum: int, _frame: FrameType | None) -> None:
        worker_state.should_stop = 0  # warm shutdown: no new task; Celery exits after the current one
        if not self.task_running:
            log.warning("worker.stopping", signal=signum)
            return
        self.stop.requested = True
        cooperative = self.stop.cooperative
        grace_s = max(self.grace_s, COOPERATIVE_GRACE_S) if cooperative else self.grace_s
        log.warning("worker.stopping_after_grace", signal=signum, grace_s=grace_s, cooperating=cooperative)
        if grace_s <= 0:
            raise WorkerPreempted(f"signal {signum}")
        signal.setitimer(signal.ITIMER_REAL, grace_s)

    def _on_grace_over(self, _signum: int, _frame: FrameType | None) -> None:
        if self.task_running:
            raise WorkerPreempted(f"grace period of {self.grace_s} s over")
