"""A dispatcher that keeps the messages in memory, for tests of the coordinator's logic."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.protocol.evals import EvalTaskMessage
from asyncgrpo.protocol.schemas import GenerateTaskMessage, OptimizeTaskMessage, RepairTaskMessage
from proxy.coordinator.dispatch import DispatchError


@dataclass
class RecordingDispatcher:
    """Keeps every message sent (as JSON-ready dicts); ``fail`` makes sends raise DispatchError."""

    generate: list[dict[str, Any]] = field(default_factory=list)
    optimize: list[dict[str, Any]] = field(default_factory=list)
    optimize_queues: list[str | None] = field(default_factory=list)  # the queue of each optimize message
    repairs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (worker_id, message)
    optimize_expires: list[float | None] = field(default_factory=list)  # the expiry of each, in seconds
    evals: list[dict[str, Any]] = field(default_factory=list)
    fail: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def send_generate(self, message: GenerateTaskMessage) -> None:
        if self.fail:
            raise DispatchError(f"recording dispatcher set to fail (generate {message.task_id})")
        with self._lock:
            self.generate.append(message.model_dump(mode="json"))

    def send_optimize(
        self, message: OptimizeTaskMessage, queue: str | None = None, expires_s: float | None = None
    ) -> None:
        if self.fail:
            raise DispatchError(f"recording dispatcher set to fail (optimize step {message.step})")
        with self._lock:
            self.optimize.append(message.model_dump(mode="json"))
            self.optimize_queues.append(queue)
            self.optimize_expires.append(expires_s)

    def send_eval(self, message: EvalTaskMessage) -> None:
        if self.fail:
            raise DispatchError(f"recording dispatcher set to fail (eval {message.task_id})")
        with self._lock:
            self.evals.append(message.model_dump(mode="json"))

    def send_repair(self, message: RepairTaskMessage, worker_id: str) -> None:
        if self.fail:
            raise DispatchError(f"recording dispatcher set to fail (repair of version {message.version})")
        with self._lock:
            self.repairs.append((worker_id, message.model_dump(mode="json")))
