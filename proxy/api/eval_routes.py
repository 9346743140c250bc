"""The evaluate tasks' routes (``[eval]``, ``proxy.coordinator.evaluations``) and their ``/metrics`` gauges.

``POST /v1/evals/{task_id}/lease`` leases the task's version (renewed and released like any lease, at
``/v1/leases/{lease_id}``); ``POST /v1/evals/{task_id}/result`` records the task's summary and releases its
lease. Both answer ``cancelled`` (410) for a task whose version is evaluated already or was given up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import FastAPI, Path

from asyncgrpo.protocol.evals import EvalLeaseGrant, EvalLeaseRequest, EvalResultAnswer, EvalResultRequest
from asyncgrpo.protocol.schemas import ID_PATTERN
from proxy.coordinator.service import Coordinator

TaskId = Annotated[str, Path(pattern=ID_PATTERN)]


def install_eval_routes(app: FastAPI, coordinator: Coordinator, poke: Callable[[], None]) -> None:
    """Add the two routes, and the eval gauges when the run evaluates. ``poke``: run a housekeeping round
    soon (a result may complete a version, whose record the round writes)."""
    if coordinator.evals.enabled:
        evals = coordinator.evals
        coordinator.metrics.watch_evals(lambda: (evals.pending_count(), evals.latest()))

    @app.post("/v1/evals/{task_id}/lease", response_model=EvalLeaseGrant)
    def grant_eval_lease(task_id: TaskId, request: EvalLeaseRequest) -> EvalLeaseGrant:
        return coordinator.eval_lease(request.worker_id, task_id, request.incarnation or "")

    @app.post("/v1/evals/{task_id}/result", response_model=EvalResultAnswer)
    def record_eval_result(task_id: TaskId, request: EvalResultRequest) -> EvalResultAnswer:
        try:
            return coordinator.eval_result(task_id, request)
        finally:
            poke()
