"""HTTP client of the proxy, used by the workers (and the CLI/tests).

Transport errors and 502/503/504 answers are retried a bounded number of times with exponential backoff
and jitter; every other refusal raises at once, one exception per kind (all ``ProxyError``). Retrying a
POST is safe by design: a repeated submit answers "duplicate", a repeated publish of the same manifest is
recognised, a repeated lease just makes a second lease that expires.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from proxy.protocol.schemas import (
    HeartbeatRequest,
    LeaseGrant,
    LeaseRequest,
    PublishRequest,
    PublishResult,
    RejectedGroup,
    RolloutSubmission,
    RunInfo,
    StatusResponse,
    StepBatch,
    SubmitResult,
    WorkerRecord,
    WorkersResponse,
)

Model = TypeVar("Model", bound=BaseModel)
RETRY_STATUSES = frozenset({502, 503, 504})


class ProxyError(Exception):
    """Base of every failure talking to the proxy; ``status``/``error``/``body`` describe the answer."""

    def __init__(self, message: str, *, status: int | None = None, error: str | None = None, body: Any = None):
        super().__init__(message)
        self.status = status
        self.error = error
        self.body = body if body is not None else {}


class StaleRollout(ProxyError):
    """409 stale: the rollout's version is too far behind; its groups were requeued."""


class Conflict(ProxyError):
    """409 conflict: a publish was refused (CAS lost, manifest missing or mismatching); drop the work."""


class NotReady(ProxyError):
    """409 not_ready: no version published yet."""


class LeaseLost(ProxyError):
    """410 lease_lost: the lease expired or is unknown."""


class Cancelled(ProxyError):
    """410 cancelled: the generate task was cancelled (timed out, superseded, unknown); drop the work."""


class Unauthorized(ProxyError):
    """401: missing or wrong ASYNCGRPO_TOKEN."""


class BadRequest(ProxyError):
    """400/422: the request does not match the protocol; the message says which field."""


class NotFound(ProxyError):
    """404: e.g. a step that was never claimed."""


class ProxyUnavailable(ProxyError):
    """The proxy could not be reached, or kept answering 502/503/504, after every retry."""


def _exception_for(status: int, error: str | None) -> type[ProxyError]:
    if status == 401:
        return Unauthorized
    if status == 409:
        return {"stale": StaleRollout, "not_ready": NotReady}.get(error or "", Conflict)
    if status == 410:
        return Cancelled if error == "cancelled" else LeaseLost
    if status in (400, 422):
        return BadRequest
    if status == 404:
        return NotFound
    if status >= 500:
        return ProxyUnavailable
    return ProxyError


class ProxyClient:
    """``ProxyClient(base_url, token)``; methods return the pydantic models of ``proxy.protocol.schemas``."""

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
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport)

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

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        for attempt in range(self.retries + 1):
            last_try = attempt == self.retries
            try:
                response = self._http.request(method, path, json=body)
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
        error = payload.get("error") if isinstance(payload, dict) else None
        detail = payload.get("detail") if isinstance(payload, dict) else str(payload)
        kind = _exception_for(response.status_code, error)
        raise kind(
            f"{method} {path} -> {response.status_code} {error or ''}: {detail}",
            status=response.status_code,
            error=error,
            body=payload,
        )

    @staticmethod
    def _body(model: type[Model], **fields: Any) -> dict[str, Any]:
        try:
            return model(**fields).model_dump(mode="json")
        except ValidationError as error:
            raise BadRequest(f"invalid {model.__name__}: {error}") from error

    # ---- API ----

    def run_info(self) -> RunInfo:
        return RunInfo.model_validate(self._request("GET", "/v1/run"))

    def lease(self, worker_id: str, task_id: str) -> LeaseGrant:
        body = self._body(LeaseRequest, worker_id=worker_id, task_id=task_id)
        return LeaseGrant.model_validate(self._request("POST", "/v1/leases", body))

    def renew(self, lease_id: str) -> LeaseGrant:
        return LeaseGrant.model_validate(self._request("POST", f"/v1/leases/{lease_id}/renew", {}))

    def release(self, lease_id: str) -> bool:
        return bool(self._request("DELETE", f"/v1/leases/{lease_id}").get("released"))

    def submit_rollout(
        self,
        *,
        task_id: str,
        worker_id: str,
        version: int,
        key: str,
        sha256: str,
        group_ids: list[str],
        num_samples: int,
        rejected_groups: Iterable[RejectedGroup | dict[str, str]] = (),
        stats: dict[str, float | int | None] | None = None,
    ) -> SubmitResult:
        body = self._body(
            RolloutSubmission,
            task_id=task_id,
            worker_id=worker_id,
            version=version,
            key=key,
            sha256=sha256,
            group_ids=list(group_ids),
            num_samples=num_samples,
            rejected_groups=[g if isinstance(g, dict) else g.model_dump() for g in rejected_groups],
            stats=stats or {},
        )
        return SubmitResult.model_validate(self._request("POST", "/v1/rollouts", body))

    def get_step(self, step: int) -> StepBatch:
        return StepBatch.model_validate(self._request("GET", f"/v1/steps/{step}"))

    def publish(
        self, version: int, base_version: int, step: int, worker_id: str, manifest_sha256: str
    ) -> PublishResult:
        body = self._body(
            PublishRequest,
            version=version,
            base_version=base_version,
            step=step,
            worker_id=worker_id,
            manifest_sha256=manifest_sha256,
        )
        return PublishResult.model_validate(self._request("POST", "/v1/versions", body))

    def heartbeat(
        self,
        *,
        worker_id: str,
        role: str,
        hostname: str,
        pid: int,
        state: str,
        versions_cached: list[int] | None = None,
        current_task: str | None = None,
        metrics_port: int | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        body = self._body(
            HeartbeatRequest,
            worker_id=worker_id,
            role=role,
            hostname=hostname,
            pid=pid,
            state=state,
            versions_cached=versions_cached or [],
            current_task=current_task,
            metrics_port=metrics_port,
            info=info or {},
        )
        self._request("POST", "/v1/workers/heartbeat", body)

    def status(self) -> StatusResponse:
        return StatusResponse.model_validate(self._request("GET", "/v1/status"))

    def workers(self) -> list[WorkerRecord]:
        return WorkersResponse.model_validate(self._request("GET", "/v1/workers")).workers
