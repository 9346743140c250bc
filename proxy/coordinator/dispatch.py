"""Sending Celery tasks by name: the proxy never imports worker code, it only knows task names and queues.

Every message goes to a queue of the run it names (``asyncgrpo.protocol.schemas``), so only that run's workers
take it, whatever other runs share the broker.

``CeleryDispatcher`` is the real one (``celery.Celery(broker=redis_url).send_task``, JSON only; a generate
message expires at its task's deadline). Tests use a recording double (``tests/support/dispatcher.py``).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog

from asyncgrpo.protocol.evals import EvalTaskMessage
from asyncgrpo.protocol.schemas import (
    EVAL_TASK_NAME,
    GENERATE_TASK_NAME,
    OPTIMIZE_TASK_NAME,
    REPAIR_TASK_NAME,
    GenerateTaskMessage,
    OptimizeTaskMessage,
    RepairTaskMessage,
    generate_queue,
    optimize_queue,
    worker_queue,
)

log = structlog.get_logger()

KWARGS_REPR_CHARS = 1024
"""As much of a task's kwargs as ``celery inspect`` shows (Celery's own limit for its repr)."""


def optimize_task_id(run: str, step: int) -> str:
    """The Celery task id of a step: the same on every re-send, so a re-send is recognisable."""
    return f"optimize-{run}-{step}"


class DispatchError(Exception):
    """The broker did not take a task (Redis down, network); the coordinator retries or requeues."""


class Dispatcher(Protocol):
    def send_generate(self, message: GenerateTaskMessage) -> None: ...

    def send_optimize(
        self, message: OptimizeTaskMessage, queue: str | None = None, expires_s: float | None = None
    ) -> None:
        """``queue``: one worker's own queue (``asyncgrpo.protocol.schemas.worker_queue``); None: the run's shared one.
        ``expires_s``: a copy not started within this many seconds (e.g. redelivered late) is dropped unrun."""
        ...

    def send_eval(self, message: EvalTaskMessage) -> None:
        """An eval task to the run's generate queue (``proxy.coordinator.evals``)."""
        ...

    def send_repair(self, message: RepairTaskMessage, worker_id: str) -> None:
        """A repair task to the own queue of ``worker_id``, the optimize worker holding the version's bytes."""
        ...


class CeleryDispatcher:
    """Send tasks to the broker at ``broker_url`` (the run's Redis) with the JSON serializer."""

    def __init__(self, broker_url: str) -> None:
        from celery import Celery  # imported here so that the proxy's logic imports without a broker

        self.app = Celery("asyncgrpo-proxy", broker=broker_url, set_as_current=False)
        self.app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            result_backend=None,
            broker_connection_retry_on_startup=True,
        )

    def _send(
        self,
        name: str,
        queue: str,
        task_id: str,
        kwargs: dict[str, Any],
        expires: float | datetime | None = None,
        *,
        quiet: bool = False,
    ) -> None:
        """``quiet``: log the send at debug level (generate tasks: one per task, most of the log at fleet scale)."""
        from kombu.exceptions import KombuError, OperationalError
        from redis.exceptions import RedisError

        try:
            self.app.send_task(
                name,
                kwargs=kwargs,
                queue=queue,
                task_id=task_id,
                serializer="json",
                expires=expires,
                retry=True,
                retry_policy={"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2},
                # What `celery inspect` shows of the task. Celery's own repr of the kwargs walks them in Python:
                # 1 % of the proxy's CPU at a thousand generate workers; the JSON encoder writes the same.
                argsrepr="()",
                kwargsrepr=json.dumps(kwargs, separators=(",", ":"))[:KWARGS_REPR_CHARS],
            )
        except (OperationalError, KombuError, RedisError, OSError) as error:
            raise DispatchError(f"broker refused task {name} {task_id}: {error}") from error
        (log.debug if quiet else log.info)("proxy.task_sent", task=name, task_id=task_id, queue=queue)

    def send_generate(self, message: GenerateTaskMessage) -> None:
        # Past its deadline the proxy no longer wants the task: the worker drops the message unrun.
        expires = None if message.expires_at is None else datetime.fromtimestamp(message.expires_at, tz=UTC)
        kwargs = message.model_dump(mode="json")
        self._send(GENERATE_TASK_NAME, generate_queue(message.run), message.task_id, kwargs, expires, quiet=True)

    def send_optimize(
        self, message: OptimizeTaskMessage, queue: str | None = None, expires_s: float | None = None
    ) -> None:
        task_id = optimize_task_id(message.run, message.step)
        kwargs = message.model_dump(mode="json")
        self._send(OPTIMIZE_TASK_NAME, queue or optimize_queue(message.run), task_id, kwargs, expires_s)

    def send_eval(self, message: EvalTaskMessage) -> None:
        # No broker expiry: a copy that runs late is refused at its lease, and the proxy re-sends it anyway.
        kwargs = message.model_dump(mode="json")
        self._send(EVAL_TASK_NAME, generate_queue(message.run), message.task_id, kwargs)

    def send_repair(self, message: RepairTaskMessage, worker_id: str) -> None:
        task_id = f"repair-{message.run}-{message.version}-{uuid.uuid4().hex[:8]}"
        self._send(REPAIR_TASK_NAME, worker_queue(message.run, worker_id), task_id, message.model_dump(mode="json"))
