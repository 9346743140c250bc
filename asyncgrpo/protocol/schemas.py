"""Every JSON message of the protocol: Celery task kwargs, HTTP request and response bodies.

The proxy validates what it receives with these models, the client returns them, and the workers validate
their task kwargs with them. Requests forbid unknown fields (a misspelt field is a 422, not a silent
default); responses allow extra fields so that a newer proxy can add some without breaking older clients.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from asyncgrpo.protocol.input_bounds import (
    MAX_INT,
    MAX_LIST,
    MAX_MAP_ENTRIES,
    MAX_NAME_CHARS,
    bounded_json,
    valid_unicode,
)

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
"""Every identifier (worker, task, lease, group): ASCII, at most 128 characters."""
SHA256_PATTERN = r"^[0-9a-f]{64}$"
LABEL_PATTERN = r"^[^\x00-\x1f\x7f]+$"
"""Short human-readable text (host names, states, reasons): any printable character, no control characters."""
_SHA = Field(pattern=SHA256_PATTERN)
Id = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
"""Versions, steps, pids, sample counts: bounded so Lua's doubles and every JSON reader hold them exactly."""
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]
Incarnation = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
"""The sending worker process's incarnation (``asyncgrpo.protocol.incarnation``); None from a client that sends
none, whose restart under the same worker id the proxy then sees only when its heartbeats stop."""
Figure = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)] | float | None


class _Request(BaseModel):
    # Requests come from the network: unknown fields, NaN/Infinity, text that is not valid UTF-8 (lone
    # surrogates from "\ud800" escapes) and values of another JSON type (false for 0, "1" for 1) are refused
    # with a 422, so nothing downstream has to cope with them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return valid_unicode(value)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- Celery task messages (kwargs of "asyncgrpo.generate" / "asyncgrpo.optimize") ----


class GroupRef(_Request):
    """One prompt group to generate: G completions of the prompt at ``prompt_index``.

    Hop: dispatched by the proxy in a generate task, passed by the task to the generate job, and stored in
    the rollout header (``asyncgrpo.protocol.records.RolloutHeader.groups``) for the optimize worker.
    """

    group_id: Id
    prompt_index: Count


class GenerateTaskMessage(_Request):
    """Kwargs of ``asyncgrpo.generate``: sent by the proxy (``proxy.coordinator.dispatch``) through the
    broker, validated by ``worker.process.tasks.generate``."""

    run: str
    task_id: Id
    groups: list[GroupRef] = Field(min_length=1)
    expires_at: float | None = None
    """Unix seconds of the task's deadline: the broker drops the message after it (the proxy no longer wants
    the task then; its prompts were requeued)."""


class RolloutRef(_Request):
    """An admitted rollout object, as named in an optimize task and in ``GET /v1/steps/{step}``.

    Hop: made by the proxy from an admitted ``RolloutSubmission`` when it claims a step, sent in the
    optimize task, and handed as is by the task to the optimize job, which fetches ``key`` and checks it
    against ``sha256``, ``version`` and ``task_id``.
    """

    task_id: Id
    key: str = Field(min_length=1)
    sha256: str = _SHA
    version: Count
    group_ids: list[Id] = Field(min_length=1, max_length=MAX_LIST)


class OptimizeTaskMessage(_Request):
    """Kwargs of ``asyncgrpo.optimize``: sent by the proxy through the broker, validated by
    ``worker.process.tasks.optimize``. Step 0 (the init version) names no rollouts."""

    run: str
    step: Count
    base_version: int = Field(ge=-1, le=MAX_INT)
    rollouts: list[RolloutRef] = Field(default_factory=list)


# ---- HTTP requests ----


class LeaseRequest(_Request):
    worker_id: Id
    task_id: Id
    incarnation: Incarnation | None = None
    """Binds the task to this process: a new incarnation of ``worker_id`` ends it at once."""


class RenewRequest(_Request):
    """Renewal takes no fields; the lease id is in the path."""


class RejectedGroup(_Request):
    """A group the generate worker refused as bad input, with the reason: in the rollout header and in the
    submission, where the proxy counts it as rejected."""

    group_id: Id
    reason: str = Field(min_length=1, max_length=200, pattern=LABEL_PATTERN)


class RolloutSubmission(_Request):
    """``POST /v1/rollouts``: the generate worker submits the rollout object it wrote; the proxy admits it
    (or refuses it as stale, cancelled, bad)."""

    task_id: Id
    worker_id: Id
    version: Count
    key: str = Field(min_length=1, max_length=1024)
    sha256: str = _SHA
    group_ids: list[Id] = Field(default_factory=list, max_length=MAX_LIST)
    num_samples: Count
    rejected_groups: list[RejectedGroup] = Field(default_factory=list, max_length=MAX_LIST)
    stats: dict[Name, Figure] = Field(default_factory=dict, max_length=MAX_MAP_ENTRIES)
    lease_id: Id | None = None
    """The task's lease: the submission must be one of its holder's leases of the task, at ``version``. It is
    released with the submission (one round trip less per task), except on a ``not_holder`` refusal, where
    it may be another worker's (the refused worker releases its own)."""


class PublishRequest(_Request):
    """``POST /v1/versions``: the optimize worker asks the proxy to publish the version it uploaded, by
    compare-and-set from ``base_version``."""

    version: Count
    base_version: int = Field(ge=-1, le=MAX_INT)
    step: Count
    worker_id: Id
    manifest_sha256: str = _SHA


class HeartbeatRequest(_Request):
    """``POST /v1/workers/heartbeat``: every worker, every few seconds, from a background thread."""

    worker_id: Id
    role: Literal["generate", "optimize"]
    hostname: str = Field(min_length=1, max_length=255, pattern=LABEL_PATTERN)
    pid: Count
    incarnation: Incarnation | None = None
    """A new one for a known ``worker_id`` (its unit restarted it) ends the old incarnation's tasks, leases and
    step at once."""
    state: str = Field(min_length=1, max_length=64, pattern=LABEL_PATTERN)
    versions_cached: list[Count] = Field(default_factory=list, max_length=1024)
    current_task: Id | None = None
    metrics_port: int | None = Field(None, ge=1, le=65535)
    info: dict[Name, Any] = Field(default_factory=dict, max_length=MAX_MAP_ENTRIES)
    """Free-form facts about the worker (backend, device), shown by ``/v1/workers``; at most 16 KiB of JSON."""

    @field_validator("info")
    @classmethod
    def _small_info(cls, value: dict[str, Any]) -> dict[str, Any]:
        return bounded_json(value)


class TaskFailureReport(_Request):
    """``POST /v1/tasks/{task_id}/failure``: a generate worker whose task failed for good (not a preemption,
    not a transient proxy or bucket error); the proxy cancels the task at once and counts the attempt."""

    worker_id: Id
    reason: str = Field(min_length=1, max_length=200, pattern=LABEL_PATTERN)
    """A short label, e.g. ``task_error_ValueError``; normalised into a rejection reason at the last attempt."""
    detail: str = Field("", max_length=2000)
    """The error message, for the proxy's log."""
    prompt_at_fault: bool = True
    """False for a failure that says nothing about the task's prompts (an adapter version that fails its
    integrity check): the task is cancelled, its prompts requeued, and no attempt is counted against them."""


# ---- HTTP responses ----


class TaskFailureResult(_Response):
    cancelled: bool
    """False if the task was no longer in flight (already cancelled, submitted, or held by another worker)."""


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
    incarnation: str | None = None
    restarts: int = 0
    """New incarnations heard under this worker id (restarts by its unit) while the proxy remembered it."""
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


class EvalSummary(_Response):
    """The newest evaluated version (``[eval]``) and its flat metrics, as in ``runs/<run>/evals/vNNNNNNNN.json``."""

    version: int
    metrics: dict[str, float]


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
    halted: str | None = None
    """Why the run's steps are halted (an operator must act), or None."""
    evals_pending: int = 0
    """Versions due for evaluation whose record is not written yet (0 without ``[eval]``)."""
    eval_latest: EvalSummary | None = None


# ---- a step's holder and its failures (dead trainers re-sent at once, poison steps end) ----

StepFailureKind = Literal["rollout", "step", "base", "upload"]


class StepStartRequest(_Request):
    """``POST /v1/steps/{step}/start``: the optimize worker starts the step and becomes its holder; the proxy
    re-sends the step at once when the holder's heartbeats stop. Refused (``not_claimed``) for a copy whose
    batch is no longer the step's: the worker drops it."""

    worker_id: Id
    base_version: int = Field(ge=-1, le=MAX_INT)
    task_ids: list[Id] = Field(default_factory=list, max_length=MAX_LIST)
    """The rollouts of the worker's message, in order."""
    incarnation: Incarnation | None = None
    """Binds the step to this process: a new incarnation of ``worker_id`` has the step re-sent at once."""


class StepStartResult(_Response):
    step: int


class StepFailureReport(_Request):
    """``POST /v1/steps/{step}/failure``: the optimize worker could not train the step.

    ``kind``: ``rollout`` (``task_id`` names the rollout the trainer cannot use: missing, failing its sha256,
    malformed, non-finite; it is rejected and the step claimed again without it), ``step`` (nothing named,
    e.g. a non-finite gradient norm: counts an attempt, up to ``async.max_step_attempts``), ``base`` (the
    worker could not load the step's base version), ``upload`` (the version's create-only manifest already
    exists, made from another batch by an attempt from before the step was claimed again: the proxy removes
    that unpublished manifest, which can never publish, and re-sends the step; no attempt is counted)."""

    worker_id: Id
    kind: StepFailureKind
    reason: str = Field(min_length=1, max_length=200, pattern=LABEL_PATTERN)
    """A short label, counted per reason like a generate worker's rejections."""
    detail: str = Field("", max_length=4000)
    task_id: Id | None = None


class StepFailureResult(_Response):
    outcome: Literal["unclaimed", "retry", "halted", "not_claimed"]
    """``unclaimed``: groups rejected, the rest buffered again; ``retry``: re-sent; ``halted``: no live worker
    can load the base version; ``not_claimed``: the step was published or un-claimed already."""
    groups_rejected: int = 0
    groups_requeued: int = 0
    attempts: int = 0


# ---- Published versions: the recorded manifest sha, corruption reports, repair tasks ----


class VersionInfo(_Response):
    """``GET /v1/versions/{version}``: the manifest sha256 the proxy recorded when it published ``version``;
    readers compare the bucket's manifest against it (a manifest changed after publish is refused)."""

    version: int
    manifest_sha256: str


class CorruptReport(_Request):
    """``POST /v1/versions/{version}/corrupt``: a worker found object ``key`` of published ``version``
    failing its sha256 check. The proxy re-reads it before acting."""

    worker_id: Id
    key: str = Field(min_length=1, max_length=1024)


class CorruptResult(_Response):
    """What the proxy did about a report: ``intact`` (it reads back fine), ``repair_sent`` (to ``holder``),
    ``halted`` (no alive worker holds the version's bytes), ``not_in_manifest`` (no such object)."""

    action: Literal["intact", "repair_sent", "halted", "not_in_manifest"]
    holder: str | None = None


class RepairTaskMessage(_Request):
    """Kwargs of ``asyncgrpo.repair_version``: put ``key`` of ``version`` back from the holder's memory."""

    run: str
    version: Count
    key: str = Field(min_length=1, max_length=1024)
    manifest_sha256: str = _SHA
