"""Every JSON message of the protocol: Celery task kwargs, HTTP request and response bodies.

The proxy validates what it receives with these models, the client returns them, and the workers validate
their task kwargs with them. Requests forbid unknown fields (a misspelt field is a 422, not a silent
default); responses allow extra fields so that a newer proxy can add some without breaking older clients.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
_ID = Field(pattern=ID_PATTERN)
_SHA = Field(pattern=SHA256_PATTERN)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- Celery task messages (kwargs of "asyncgrpo.generate" / "asyncgrpo.optimize") ----


class GroupRef(_Request):
    """One prompt group to generate: G completions of the prompt at ``prompt_index``.

    Hop: dispatched by the proxy in a generate task, passed by the task to the generate job, and stored in
    the rollout header (``proxy.protocol.records.RolloutHeader.groups``) for the optimize worker.
    """

    group_id: str = _ID
    prompt_index: int = Field(ge=0)


class GenerateTaskMessage(_Request):
    """Kwargs of ``asyncgrpo.generate``: sent by the proxy (``proxy.coordinator.dispatch``) through the
    broker, validated by ``worker.process.tasks.generate``."""

    run: str
    task_id: str = _ID
    groups: list[GroupRef] = Field(min_length=1)


class RolloutRef(_Request):
    """An admitted rollout object, as named in an optimize task and in ``GET /v1/steps/{step}``.

    Hop: made by the proxy from an admitted ``RolloutSubmission`` when it claims a step, sent in the
    optimize task, and handed as is by the task to the optimize job, which fetches ``key`` and checks it
    against ``sha256``, ``version`` and ``task_id``.
    """

    task_id: str = _ID
    key: str = Field(min_length=1)
    sha256: str = _SHA
    version: int = Field(ge=0)
    group_ids: list[str] = Field(min_length=1)


class OptimizeTaskMessage(_Request):
    """Kwargs of ``asyncgrpo.optimize``: sent by the proxy through the broker, validated by
    ``worker.process.tasks.optimize``. Step 0 (the init version) names no rollouts."""

    run: str
    step: int = Field(ge=0)
    base_version: int = Field(ge=-1)
    rollouts: list[RolloutRef] = Field(default_factory=list)


# ---- HTTP requests ----


class LeaseRequest(_Request):
    worker_id: str = _ID
    task_id: str = _ID


class RenewRequest(_Request):
    """Renewal takes no fields; the lease id is in the path."""


class RejectedGroup(_Request):
    """A group the generate worker refused as bad input, with the reason: in the rollout header and in the
    submission, where the proxy counts it as rejected."""

    group_id: str = _ID
    reason: str = Field(min_length=1, max_length=200)


class RolloutSubmission(_Request):
    """``POST /v1/rollouts``: the generate worker submits the rollout object it wrote; the proxy admits it
    (or refuses it as stale, cancelled, bad)."""

    task_id: str = _ID
    worker_id: str = _ID
    version: int = Field(ge=0)
    key: str = Field(min_length=1, max_length=1024)
    sha256: str = _SHA
    group_ids: list[str] = Field(default_factory=list)
    num_samples: int = Field(ge=0)
    rejected_groups: list[RejectedGroup] = Field(default_factory=list)
    stats: dict[str, float | int | None] = Field(default_factory=dict)
    lease_id: str | None = Field(None, pattern=ID_PATTERN)
    """The task's lease, released with the submission (one round trip less per task); whatever the answer,
    the worker no longer needs the version."""


class PublishRequest(_Request):
    """``POST /v1/versions``: the optimize worker asks the proxy to publish the version it uploaded, by
    compare-and-set from ``base_version``."""

    version: int = Field(ge=0)
    base_version: int = Field(ge=-1)
    step: int = Field(ge=0)
    worker_id: str = _ID
    manifest_sha256: str = _SHA


class HeartbeatRequest(_Request):
    """``POST /v1/workers/heartbeat``: every worker, every few seconds, from a background thread."""

    worker_id: str = _ID
    role: Literal["generate", "optimize"]
    hostname: str = Field(min_length=1, max_length=255)
    pid: int = Field(ge=0)
    state: str = Field(min_length=1, max_length=64)
    versions_cached: list[int] = Field(default_factory=list, max_length=1024)
    current_task: str | None = None
    metrics_port: int | None = Field(None, ge=1, le=65535)
    info: dict[str, Any] = Field(default_factory=dict)


# ---- HTTP responses ----


class RunInfo(_Response):
    run: str
    config_key: str
    config_sha256: str
    prompts_key: str
    prompts_sha256: str
    num_prompts: int
    current_version: int


class LeaseGrant(_Response):
    lease_id: str
    version: int
    adapter_prefix: str
    manifest_key: str
    manifest_sha256: str
    ttl_s: float
    expires_at: float
    """Unix time (seconds) at which the lease lapses unless renewed."""


class LatestVersion(_Response):
    """Answer to ``GET /v1/versions/latest?after=N&wait_s=S``: the current version, sent at once when it is
    newer than ``after``, else when one is published or ``wait_s`` runs out (then it is the same one).

    Hop: from the proxy to each generate worker's adapter prefetcher (``worker.generate.prefetch``), which
    fetches ``manifest_key`` and checks it against ``manifest_sha256`` exactly as for a lease.
    """

    run: str
    version: int
    """-1 before the init step published version 0 (then the manifest fields are None)."""
    adapter_prefix: str | None
    manifest_key: str | None
    manifest_sha256: str | None


class SubmitResult(_Response):
    status: Literal["admitted", "duplicate"]


class StepBatch(_Response):
    step: int
    base_version: int
    rollouts: list[RolloutRef]


class PublishResult(_Response):
    current_version: int


class HeartbeatResult(_Response):
    ok: bool = True


class ReleaseResult(_Response):
    """Answer to ``DELETE /v1/leases/{lease_id}``."""

    released: bool
    """False when the lease had already lapsed or was unknown."""


class WorkerRecord(_Response):
    worker_id: str
    role: str
    hostname: str
    pid: int
    state: str
    versions_cached: list[int]
    current_task: str | None
    metrics_port: int | None
    info: dict[str, Any]
    last_seen: float
    """Unix time (seconds) of the last heartbeat."""
    alive: bool


class WorkersResponse(_Response):
    workers: list[WorkerRecord]


class LeaseRecord(_Response):
    lease_id: str
    version: int
    worker_id: str
    task_id: str
    expires_at: float


class StatusResponse(_Response):
    run: str
    current_version: int
    final_version: int
    """The run ends when current_version reaches it (optimizer.total_steps / async.publish_every)."""
    finished: bool
    step_inflight: int | None
    epoch: int
    epoch_pos: int
    groups_buffered: int
    groups_inflight: int
    groups_requeued: int
    tasks_inflight: int
    counters: dict[str, int]
    rejected_by_reason: dict[str, int]
    leases: list[LeaseRecord]
    workers_alive_by_role: dict[str, int]


class ErrorBody(_Response):
    """Body of every 4xx/5xx answer: ``error`` is a stable code, ``detail`` a sentence for humans."""

    error: str
    detail: str
