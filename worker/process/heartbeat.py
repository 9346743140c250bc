"""Heartbeats to the proxy from a background thread.

A solo Celery worker does not answer ``celery inspect`` while it runs a task, so each worker also tells the
proxy every few seconds that it is alive, what it is doing and which adapter versions it holds.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx
import structlog

from asyncgrpo.protocol.client import ProxyClient, ProxyError, process_incarnation
from asyncgrpo.protocol.schemas import HeartbeatRequest

log = structlog.get_logger()


class Heartbeat:
    def __init__(
        self,
        client: ProxyClient,
        worker_id: str,
        role: str,
        interval_s: float,
        describe: Callable[[], dict[str, Any]],
        metrics_port: int | None = None,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.role = role
        self.interval_s = interval_s
        self.describe = describe
        self.metrics_port = metrics_port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="asyncgrpo-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        state = self.describe()
        self.client.heartbeat(
            HeartbeatRequest(
                worker_id=self.worker_id,
                role=self.role,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                incarnation=process_incarnation(),
                state=state.get("state", "idle"),
                versions_cached=state.get("versions_cached", []),
                current_task=state.get("current_task"),
                metrics_port=self.metrics_port,
                info=state.get("info", {}),
            )
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except (ProxyError, httpx.HTTPError) as error:
                # The proxy may be restarting; the next beat will tell it we are alive.
                log.warning("worker.heartbeat_failed", error=str(error))
            self._stop.wait(self.interval_s)
