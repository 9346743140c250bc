"""Sending Celery tasks by name: the proxy never imports worker code, it only knows task names and queues.

``CeleryDispatcher`` is the real one (``celery.Celery(broker=redis_url).send_task``, JSON only);
``RecordingDispatcher`` keeps the messages in memory for tests of the coordinator's logic.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from proxy.protocol.schemas import GenerateTaskMessage, OptimizeTaskMessage

log = structlog.get_logger()

GENERATE_TASK_NAME = "asyncgrpo.generate"
OPTIMIZE_TASK_NAME = "asyncgrpo.optimize"
GENERATE_QUEUE = "generate"
OPTIMIZE_QUEUE = "optimize"


def optimize_task_id(run: str, step: int) -> str:
    """The Celery task id of a step: the same on every re-send, so a re-send is recognisable."""
    return f"optimize-{run}-{step}"


class DispatchError(Exception):
    """The broker did not take a task (Redis down, network); the coordinator retries or requeues."""


class Dispatcher(Protocol):
    def send_generate(self, message: GenerateTaskMessage) -> None: ...

    def send_optimize(self, message: OptimizeTaskMessage) -> None: ...


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

    def _send(self, name: str, queue: str, task_id: str, kwargs: dict[str, Any]) -> None:
        from kombu.exceptions import KombuError, OperationalError
        from redis.exceptions import RedisError

        try:
            self.app.send_task(
                name,
                kwargs=kwargs,
                queue=queue,
                task_id=task_id,
                serializer="json",
                retry=True,
                retry_policy={"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2},
            )
        except (OperationalError, KombuError, RedisError, OSError) as error:
            raise DispatchError(f"broker refused task {name} {task_id}: {error}") from error
        log.info("proxy.task_sent", task=name, task_id=task_id, queue=queue)

    def send_generate(self, message: GenerateTaskMessage) -> None:
        self._send(GENERATE_TASK_NAME, GENERATE_QUEUE, message.task_id, message.model_dump(mode="json"))

    def send_optimize(self, message: OptimizeTaskMessage) -> None:
        task_id = optimize_task_id(message.run, message.step)
        self._send(OPTIMIZE_TASK_NAME, OPTIMIZE_QUEUE, task_id, message.model_dump(mode="json"))


@dataclass
class RecordingDispatcher:
    """Keeps every message sent (as JSON-ready dicts); ``fail`` makes sends raise DispatchError."""

    generate: list[dict[str, Any]] = field(default_factory=list)
    optimize: list[dict[str, Any]] = field(default_factory=list)
    fail: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def send_generate(self, message: GenerateTaskMessage) -> None:
        if self.fail:
            raise DispatchError(f"recording dispatcher set to fail (generate {message.task_id})")
        with self._lock:
            self.generate.append(message.model_dump(mode="json"))

    def send_optimize(self, message: OptimizeTaskMessage) -> None:
        if self.fail:
            raise DispatchError(f"recording dispatcher set to fail (optimize step {message.step})")
        with self._lock:
            self.optimize.append(message.model_dump(mode="json"))
