"""HTTP client of the proxy, used by the workers (and the CLI/tests).

Transport errors and 502/503/504 answers are retried a bounded number of times with exponential backoff
and jitter; every other refusal raises at once, the exception that ``asyncgrpo.protocol.errors`` names for its
error code (all ``ProxyError``). Retrying a POST is safe by design: a repeated submit answers "duplicate",
a repeated publish of the same manifest is recognised, a repeated lease just makes a second lease that
expires.

This process's incarnation: what tells a restarted worker from the process that had its worker id before.

A systemd unit or a Procfile restarts a crashed worker under the same ``ASYNCGRPO_WORKER_ID`` within seconds,
so heartbeats alone cannot tell the proxy that the old process is gone: the id never goes silent. Every worker
sends its incarnation with its heartbeats, leases and step starts; the proxy ends whatever an older
incarnation of the id still held (tasks, leases, steps) as soon as it hears a new one.

An incarnation is the machine's boot id, the pid and the process's start time (clock ticks since boot), so it
is the same for every thread of one process, readable by an operator in ``/v1/workers``, and never repeats:
the pid and start time together are unique within a boot, and the boot id across boots. Where ``/proc`` does
not exist, a random id drawn once per process stands in.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from asyncgrpo.protocol.errors import ErrorBody, ProxyError, ProxyUnavailable, exception_for
from asyncgrpo.protocol.evals import EvalLeaseGrant, EvalLeaseRequest, EvalResultAnswer, EvalResultRequest
from asyncgrpo.protocol.schemas import (
    CorruptReport,
    CorruptResult,
    HeartbeatRequest,
    HeartbeatResult,
    LatestVersion,
    LeaseGrant,
    LeaseRequest,
    PublishRequest,
    PublishResult,
    ReleaseResult,
    RenewRequest,
    RolloutSubmission,
    RunInfo,
    StatusResponse,
    StepBatch,
    StepFailureReport,
    StepFailureResult,
    StepStartRequest,
    StepStartResult,
    SubmitResult,
    TaskFailureReport,
    TaskFailureResult,
    VersionInfo,
    WorkerRecord,
    WorkersResponse,
)

_cached: tuple[int, str] | None = None


def _linux_incarnation(pid: int) -> str | None:
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:12]
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 is the start time; the command name (field 2) may hold spaces, so count after its ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return f"{boot_id}-{pid}-{fields[19]}"


def process_incarnation() -> str:
    """This process's incarnation (matches ``schemas.ID_PATTERN``); a forked child gets its own."""
    global _cached
    pid = os.getpid()
    if _cached is None or _cached[0] != pid:
        _cached = (pid, _linux_incarnation(pid) or f"{uuid.uuid4().hex[:12]}-{pid}")
    return _cached[1]


# Callers that catch any failure of the client need not know the error table.
__all__ = ["RETRY_STATUSES", "ProxyClient", "ProxyError", "ProxyUnavailable"]

RETRY_STATUSES = frozenset({502, 503, 504})
KEEP_ALIVE_S = 30.0
"""Seconds an idle connection to the proxy is kept for the next request (httpx's default is 5)."""


class ProxyClient:
    """``ProxyClient(base_url, token)``; methods take and return the models of ``asyncgrpo.protocol.schemas``."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout_s: float = 10,
        retries: int = 4,
        *,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep
        # Idle connections are kept past the heartbeat interval (5 s), so a heartbeat reuses its connection
        # instead of opening one each time; the proxy keeps them longer still (``KEEP_ALIVE_S``), so the
        # client is always the side that closes an idle one.
        limits = httpx.Limits(keepalive_expiry=KEEP_ALIVE_S)
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport, limits=limits
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ProxyClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- plumbing ----

    def _backoff(self, attempt: int) -> None:
        delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        self._sleep(delay * random.uniform(0.5, 1.0))

    def _request(
        self,
        method: str,
        path: str,
        body: BaseModel | None = None,
        *,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        payload = body.model_dump(mode="json") if body is not None else None
        extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        for attempt in range(self.retries + 1):
            last_try = attempt == self.retries
            try:
                response = self._http.request(method, path, json=payload, params=params, **extra)
            except httpx.TransportError as error:
                if last_try:
                    raise ProxyUnavailable(
                        f"{method} {self.base_url}{path} failed after {attempt + 1} attempts: {error!r}"
                    ) from error
                self._backoff(attempt)
                continue
            if response.status_code in RETRY_STATUSES and not last_try:
                self._backoff(attempt)
                continue
            return self._answer(method, path, response)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _answer(self, method: str, path: str, response: httpx.Response) -> Any:
        try:
            payload = response.json()
        except ValueError:
            payload = {"detail": response.text[:500]}
        if response.is_success:
            return payload
        try:
            refusal = ErrorBody.model_validate(payload)
            code, detail = refusal.error, refusal.detail
        except ValidationError:
            # Not the proxy's own refusal (a reverse proxy's page, FastAPI's 404): judged by its status.
            code, detail = None, str(payload)[:500]
        kind = exception_for(response.status_code, code)
        raise kind(
            f"{method} {path} -> {response.status_code} {code or ''}: {detail}",
            status=response.status_code,
            error=code,
            body=payload,
        )

    # ---- API ----

    def run_info(self) -> RunInfo:
        return RunInfo.model_validate(self._request("GET", "/v1/run"))

    def lease(self, request: LeaseRequest) -> LeaseGrant:
        return LeaseGrant.model_validate(self._request("POST", "/v1/leases", request))

    def renew(self, lease_id: str) -> LeaseGrant:
        return LeaseGrant.model_validate(self._request("POST", f"/v1/leases/{lease_id}/renew", RenewRequest()))

    def release(self, lease_id: str) -> ReleaseResult:
        return ReleaseResult.model_validate(self._request("DELETE", f"/v1/leases/{lease_id}"))

    def submit_rollout(self, submission: RolloutSubmission) -> SubmitResult:
        return SubmitResult.model_validate(self._request("POST", "/v1/rollouts", submission))

    def report_task_failure(self, task_id: str, report: TaskFailureReport) -> TaskFailureResult:
        """Tell the proxy a generate task failed for good: it cancels the task and counts the attempt."""
        return TaskFailureResult.model_validate(self._request("POST", f"/v1/tasks/{task_id}/failure", report))

    def get_step(self, step: int) -> StepBatch:
        return StepBatch.model_validate(self._request("GET", f"/v1/steps/{step}"))

    def start_step(self, step: int, request: StepStartRequest) -> StepStartResult:
        """Become the step's holder; raises StepGone for a copy whose batch is no longer the step's."""
        return StepStartResult.model_validate(self._request("POST", f"/v1/steps/{step}/start", request))

    def report_step_failure(self, step: int, report: StepFailureReport) -> StepFailureResult:
        return StepFailureResult.model_validate(self._request("POST", f"/v1/steps/{step}/failure", report))

    def publish(self, request: PublishRequest) -> PublishResult:
        return PublishResult.model_validate(self._request("POST", "/v1/versions", request))

    def latest_version(self, after: int = -1, wait_s: float = 0.0) -> LatestVersion:
        """The current version: at once if newer than ``after``, else when one is published or after ``wait_s``
        seconds (a long poll; the HTTP timeout is stretched to cover the wait)."""
        timeout_s = self._http.timeout.read
        stretched = None if timeout_s is None else timeout_s + wait_s
        return LatestVersion.model_validate(
            self._request("GET", "/v1/versions/latest", params={"after": after, "wait_s": wait_s}, timeout_s=stretched)
        )

    def heartbeat(self, report: HeartbeatRequest) -> HeartbeatResult:
        return HeartbeatResult.model_validate(self._request("POST", "/v1/workers/heartbeat", report))

    def status(self) -> StatusResponse:
        return StatusResponse.model_validate(self._request("GET", "/v1/status"))

    def workers(self) -> list[WorkerRecord]:
        return WorkersResponse.model_validate(self._request("GET", "/v1/workers")).workers

    # ---- published versions (the recorded manifest sha, corruption reports) ----

    def version_info(self, version: int) -> VersionInfo:
        """The manifest sha256 the proxy recorded for published ``version``; NotFound if it never published it."""
        return VersionInfo.model_validate(self._request("GET", f"/v1/versions/{version}"))

    def report_corrupt(self, version: int, worker_id: str, key: str) -> CorruptResult:
        """Tell the proxy that object ``key`` of published ``version`` failed its sha256 check."""
        return CorruptResult.model_validate(
            self._request("POST", f"/v1/versions/{version}/corrupt", CorruptReport(worker_id=worker_id, key=key))
        )

    # ---- evaluation during training ([eval]) ----

    def eval_lease(self, task_id: str, worker_id: str) -> EvalLeaseGrant:
        """Lease the version of eval task ``task_id``; raises Cancelled when its evaluation is over."""
        request = EvalLeaseRequest(worker_id=worker_id, incarnation=process_incarnation())
        return EvalLeaseGrant.model_validate(self._request("POST", f"/v1/evals/{task_id}/lease", request))

    def eval_result(self, task_id: str, request: EvalResultRequest) -> EvalResultAnswer:
        """Post an eval task's summary (its lease is released); raises Cancelled when it is not wanted."""
        return EvalResultAnswer.model_validate(self._request("POST", f"/v1/evals/{task_id}/result", request))
