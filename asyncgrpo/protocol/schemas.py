"""The wire: every JSON message (Celery task kwargs, HTTP request and response bodies), the limits on what a
request may carry, the Celery task and queue names, and the staleness rule.

The proxy validates what it receives with these models, the client returns them, and the workers validate
their task kwargs with them. Requests forbid unknown fields (a misspelt field is a 422, not a silent
default); responses allow extra fields so that a newer proxy can add some without breaking older clients.

Limits, shared by the request schemas and the proxy's error answers.

Everything a client sends is bounded: identifiers by ``ID_PATTERN``, numbers by ``MAX_INT``, text and
lists by their lengths, free-form maps by entry count and encoded size, and the whole body by the proxy's
``ASYNCGRPO_MAX_BODY_BYTES``. Text must be valid UTF-8: JSON's ``"\ud800"`` escape decodes to a lone
surrogate, which no JSON encoder, Redis script or log line can write back.

Celery task names and queues: the contract between the proxy, which sends tasks by name, and the workers.

Queues are named per run, so several runs share one Redis broker without taking each other's tasks::

    asyncgrpo:<run>:generate                  every generate worker of the run
    asyncgrpo:<run>:optimize                  every optimize worker of the run
    asyncgrpo:<run>:optimize:<worker_id>      only the optimize worker ``worker_id`` of the run

``:`` never occurs in a run name (``asyncgrpo.bucket.layout``: letters, digits, ``.``, ``_``, ``-``), so the
prefix ``asyncgrpo:<run>:`` names exactly one run: with ``.`` as the separator, the generate queue of run
``a.optimize`` would be the own queue of worker ``generate`` of run ``a``. The coordinator's own keys are
``asyncgrpo:{<run>}:...`` (braces, ``proxy.coordinator.redis_store``), which no queue name matches.

Every optimize worker consumes its run's ``optimize`` queue and a queue of its own (``worker_queue``), so
the proxy can send a step to the trainer that already holds the step's base version in memory, and a repair
to the one that holds a version's files; a step sent there while that worker is alive goes nowhere else.

The staleness rule, in one place: the proxy (at admit and at claim) and the trainer both call it.

A sample generated with policy version ``n`` and trained in an optimizer step that starts from version
``c`` has staleness ``c - n``. It may be used iff ``c - n <= max_staleness`` (config field
``async.max_staleness``). A sample from a version newer than ``c`` cannot exist; asking about one is a bug
and raises ``ValueError``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

MAX_INT = 2**31 - 1
"""Versions, steps, pids and counts: far beyond any run, and exact as a double (Lua) and in every JSON reader."""
MAX_LIST = 4096
"""Entries of an id list in one request (a task's groups, a step's rollouts)."""
MAX_MAP_ENTRIES = 64
"""Entries of a free-form map (a submission's ``stats``, a heartbeat's ``info``)."""
MAX_NAME_CHARS = 64
"""A key of a free-form map."""
MAX_INFO_BYTES = 16 * 1024
"""A heartbeat's ``info`` map, encoded as JSON."""


def is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_unicode(value: Any) -> Any:
    """``value`` unchanged if every string in it (keys included) is valid UTF-8; else ValueError."""
    pending = [value]
    while pending:  # iterative: a deeply nested value must not overflow the stack here
        item = pending.pop()
        if isinstance(item, str):
            if not is_valid_unicode(item):
                raise ValueError("text holds a lone surrogate (e.g. from a \\ud800 escape); send valid UTF-8")
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return value


def bounded_json(value: dict[str, Any], limit: int = MAX_INFO_BYTES) -> dict[str, Any]:
    """``value`` unchanged if it encodes to at most ``limit`` bytes of JSON (no NaN/Infinity); else ValueError."""
    try:
        size = len(json.dumps(value, allow_nan=False, separators=(",", ":")).encode())
    except (ValueError, TypeError, RecursionError) as error:
        raise ValueError(f"must be plain JSON (finite numbers, text, lists, maps): {error}") from None
    if size > limit:
        raise ValueError(f"encodes to {size} bytes of JSON; at most {limit} are kept")
    return value


def printable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters and made safe to send back (lone surrogates escaped)."""
    cut = text[:limit]
    safe = cut.encode("utf-8", "backslashreplace").decode("utf-8")
    return safe + ("..." if len(text) > limit else "")


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
"""The sending worker process's incarnation (``asyncgrpo.protocol.client``); None from a client that sends
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
    newest_version: Count | None = None
    """The version of the rollout's newest token where its sequences followed newer versions
    (``async.inflight_versions = "follow"``); None: every token is ``version``'s. With ``async.stale_tokens =
    "mask"`` admission and claim check this one, and the trainer masks the tokens older than the window."""
    oldest_version: Count | None = None
    """The version of the rollout's oldest token where a sequence continues a partial one an earlier task saved
    (``async.partial_rollouts``), older than ``version``; None: no token is older than ``version``. Admission
    and claim check this one (with ``async.stale_tokens = "drop"``), not the leased ``version``."""


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

    Hop: from the proxy to each generate worker's adapter prefetcher (``worker.generate.job``), which
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


class FleetView(_Response):
    """The autoscaling signal: the generate workers that keep the trainer busy, and the measurements it comes
    from (``proxy.coordinator.generate_tasks``); in ``/v1/status`` and the proxy's metrics."""

    wanted: int
    """0 once the run reached its final version."""
    submitting: int
    """Generate workers that submitted within the pacing window."""
    step_s: float
    """The trainer's time per version (median of the recent ones): optimize task sent to publish."""
    task_s: float
    """A generate task's service time (median): lease to submission."""
    tasks_per_version: int


class RunCounts(_Response):
    """The run's state as counts: what ``/v1/status`` answers and ``/metrics`` exports alike (the proxy's
    ``StateGauges`` adds the live leases' count to it)."""

    current_version: int
    final_version: int
    """The run ends when current_version reaches it (optimizer.total_steps / async.publish_every)."""
    step_inflight: int | None
    epoch: int
    groups_buffered: int
    groups_inflight: int
    groups_requeued: int
    tasks_inflight: int
    counters: dict[str, int]
    rejected_by_reason: dict[str, int]
    workers_alive_by_role: dict[str, int]
    halted: str | None = None
    """Why the run's steps are halted (an operator must act), or None."""


class StatusResponse(RunCounts):
    run: str
    finished: bool
    epoch_pos: int
    leases: list[LeaseRecord]
    evals_pending: int = 0
    """Versions due for evaluation whose record is not written yet (0 without ``[eval]``)."""
    eval_latest: EvalSummary | None = None
    fleet: FleetView | None = None
    """None until this proxy process has measured the trainer's steps and the generate tasks."""


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


# ---- the staleness rule: at admit, at claim and in the trainer ----


class StaleRolloutError(Exception):
    """A sample is too old to be used in a gradient step; the message says what to change."""

    def __init__(self, sample_version: int, current: int, max_staleness: int) -> None:
        self.sample_version = sample_version
        self.current = current
        self.max_staleness = max_staleness
        self.behind = current - sample_version
        super().__init__(
            f"rollout v{sample_version} is {self.behind} versions behind v{current} "
            f"(async.max_staleness={max_staleness}); add generate workers or raise async.max_staleness"
        )


def staleness(current: int, sample_version: int) -> int:
    """How many versions the sample lags behind ``current`` (0: made with the current policy)."""
    if sample_version < 0:
        raise ValueError(f"sample version must be >= 0, got {sample_version}")
    if sample_version > current:
        raise ValueError(
            f"sample version v{sample_version} is newer than the current version v{current}: "
            "no such policy was published"
        )
    return current - sample_version


def is_fresh(current: int, sample_version: int, max_staleness: int) -> bool:
    """True iff a sample of ``sample_version`` may train a step that starts from ``current``."""
    if max_staleness < 0:
        raise ValueError(f"async.max_staleness must be >= 0, got {max_staleness}")
    return staleness(current, sample_version) <= max_staleness


def check_fresh(current: int, sample_version: int, max_staleness: int) -> None:
    """Raise :class:`StaleRolloutError` unless the sample is fresh enough."""
    if not is_fresh(current, sample_version, max_staleness):
        raise StaleRolloutError(sample_version, current, max_staleness)


# ---- Celery task names and queue names ----


GENERATE_TASK_NAME = "asyncgrpo.generate"
OPTIMIZE_TASK_NAME = "asyncgrpo.optimize"
EVAL_TASK_NAME = "asyncgrpo.evaluate"
"""Sent to the run's generate queue: evaluate one version on a chunk of the held-out prompts. The name keeps its
first spelling (the code says "eval"): tasks already queued under it must still run."""
REPAIR_TASK_NAME = "asyncgrpo.repair_version"
"""Sent only to a worker's own queue: put a corrupted object of a version back from the holder's memory."""

QUEUE_PREFIX = "asyncgrpo"
SEPARATOR = ":"
ROLES = ("generate", "optimize")
# Every run name, in queue names and bucket keys alike (``asyncgrpo.bucket.layout.check_run_name``): none
# holds the separator, a comma (``celery worker --queues`` splits on it), a slash or a space.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RUN_NAME_RULE = "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
_WORKER_ID = re.compile(ID_PATTERN)


def check_queue_run(run: str) -> str:
    """``run`` if it can be part of a queue name, else ValueError saying which names are allowed."""
    if not RUN_NAME.fullmatch(run):  # fullmatch: no trailing newline slips through
        raise ValueError(f"run name {run!r} cannot name a queue: {RUN_NAME_RULE}")
    return run


def run_queue_prefix(run: str) -> str:
    """What every queue of ``run`` starts with, and no queue of another run does."""
    return f"{QUEUE_PREFIX}{SEPARATOR}{check_queue_run(run)}{SEPARATOR}"


def role_queue(run: str, role: str) -> str:
    """The queue every worker of ``role`` in ``run`` consumes."""
    if role not in ROLES:
        raise ValueError(f"worker role {role!r} is unknown; use one of {', '.join(ROLES)}")
    return run_queue_prefix(run) + role


def generate_queue(run: str) -> str:
    return role_queue(run, "generate")


def optimize_queue(run: str) -> str:
    return role_queue(run, "optimize")


def worker_queue(run: str, worker_id: str) -> str:
    """The queue only the optimize worker ``worker_id`` of ``run`` consumes."""
    if not _WORKER_ID.fullmatch(worker_id):  # fullmatch: no trailing newline slips through
        raise ValueError(f"worker id {worker_id!r} cannot name a queue: it must match {ID_PATTERN}")
    return optimize_queue(run) + SEPARATOR + worker_id


def worker_queues(run: str, role: str, worker_id: str) -> list[str]:
    """Every queue a worker of ``role`` in ``run`` consumes: its role's queue, plus its own for optimize workers."""
    if role == "optimize":
        return [optimize_queue(run), worker_queue(run, worker_id)]
    return [role_queue(run, role)]
