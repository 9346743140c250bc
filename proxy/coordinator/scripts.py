"""The coordinator's Lua scripts, declared: every change to a run's Redis state is one of these, so it is atomic.

The scripts are the files ``lua/<name>.lua``; each starts with lines stating its KEYS, ARGV and return codes,
and each declaration below restates them (``proxy.coordinator.lua_script`` says how). A script returns a
table whose first element is a code string; every code that is not an answer maps to its own exception.
Time is always passed in (``now_ms``) so that tests control the clock; leases also get a real ``PEXPIRE``
as a backstop. Item keys (one per group, task, rollout, step, lease, worker) are built inside the scripts
as ``prefix .. kind .. ':' .. id`` with the kinds of ``proxy.coordinator.redis_keys`` substituted in.

Group states: ``inflight`` (in a generate task) -> ``buffered`` (admitted) -> ``claimed`` (in a step) ->
``trained``; or one of the other terminal states ``stale`` (requeued as a new group), ``rejected``
(bad input, with a reason) or ``cancelled`` (its task was lost; requeued). Terminal records expire after
``record_ttl_s`` so that Redis does not grow with the length of the run.

Rollout retention: when a rollout can never be trained (again) -- its step was published, or it was dropped as
stale, rejected, or its task was cancelled -- its task id goes into the ``rollout_retention`` sorted set,
scored with the version after which its bucket object may go (the version its step produced, else the
current one). Scripts that do so take a ``track`` argument: "0" (``async.rollout_retention_versions = -1``)
keeps every rollout and records nothing. DUE_ROLLOUTS and FORGET_ROLLOUTS serve the proxy's collection.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.coordinator.errors import (
    BadRollout,
    BadStepFailure,
    BadVersionNumber,
    BufferFull,
    CasLost,
    EpochMoved,
    LeaseLostError,
    NotTaskHolder,
    NoVersionYet,
    RolloutTooStale,
    StateExists,
    StateMissing,
    StepNoLongerClaimed,
    StepNotClaimed,
    StepNotReady,
    TaskCancelled,
    TaskEnded,
    UnknownTask,
)
from proxy.coordinator.eval_scripts import (
    CLOSE_EVAL,
    FINISH_EVAL_CHUNK,
    GRANT_EVAL_LEASE,
    RETRY_EVALS,
    SCHEDULE_EVAL,
)
from proxy.coordinator.lua_script import NO_STATE, BoundScript, LuaScript, Refusal

# Every script that reads the run's state refuses with NO_STATE when there is none; the store rebuilds once.
_NO_STATE = {NO_STATE: Refusal(StateMissing, "Redis holds no state for run {run!r} even after a rebuild")}
_PUBLISH_REFUSED = (
    "publish of v{version} from base v{base_version} (step {step}) refused ({code}): the current version is v{current}"
)
_CURRENT = ("current",)

DISPATCH_GENERATE = LuaScript(
    name="dispatch_generate",
    keys=("state", "counters", "requeue", "tasks_inflight", "prompt_attempts"),
    argv=(
        "now_ms",
        "deadline_ms",
        "groups_per_task",
        "queue_maxsize",
        "epoch",
        "epoch_pos",
        "num_prompts",
        "run",
        "*candidates",
    ),
    ok={"OK": ("task_id", "groups_json")},
    errors={
        "NO_ROOM": Refusal(BufferFull, "run {run!r}: the buffer has no room for {groups_per_task} more groups"),
        "RETRY": Refusal(EpochMoved, "run {run!r}: the prompt order moved past epoch {epoch} position {epoch_pos}"),
        **_NO_STATE,
    },
)

CANCEL_TASKS = LuaScript(
    name="cancel_tasks",
    keys=(
        "state",
        "counters",
        "requeue",
        "tasks_inflight",
        "rollout_retention",
        "rejected_reasons",
        "prompt_attempts",
        "workers",
    ),
    argv=(
        "now_ms",
        "record_ttl_s",
        "mode",
        "track",
        "max_attempts",
        "reason",
        "alive_since_ms",
        "worker_id",
        "*task_ids",
    ),
    ok={"OK": ("tasks_cancelled", "groups_requeued", "groups_rejected")},
    errors=_NO_STATE,
)

UNDO_DISPATCH = LuaScript(
    name="undo_dispatch",
    keys=("state", "counters", "requeue", "tasks_inflight"),
    argv=("*task_ids",),
    ok={"OK": ("tasks_undone", "groups_undone")},
    errors=_NO_STATE,
)

SUBMIT_ROLLOUT = LuaScript(
    name="submit_rollout",
    keys=(
        "state",
        "counters",
        "rejected_reasons",
        "requeue",
        "tasks_inflight",
        "buffer",
        "rollout_retention",
        "prompt_attempts",
    ),
    argv=(
        "now_ms",
        "max_staleness",
        "record_ttl_s",
        "task_id",
        "worker_id",
        "version",
        "ref_json",
        "admitted_json",
        "rejected_json",
        "omitted_reason",
        "track",
        "sha256",
        "lease_id",
    ),
    # a repeated submission of an admitted rollout is answered like the first (the worker's retry)
    ok={"OK": _CURRENT, "DUPLICATE": _CURRENT},
    fields={"STALE": _CURRENT, "BAD_ROLLOUT": ("message",), "NOT_HOLDER": ("message",)},
    errors={
        "STALE": Refusal(
            RolloutTooStale, "rollout v{version} of task {task_id} is too stale for v{current}", passed=_CURRENT
        ),
        "CANCELLED": Refusal(
            TaskCancelled,
            "task {task_id} was cancelled (not submitted within async.generate_task_timeout_s, or lost in a proxy "
            "rebuild); its prompts were requeued",
        ),
        "UNKNOWN_TASK": Refusal(UnknownTask, "task {task_id} was never dispatched by the proxy of run {run!r}"),
        "BAD_ROLLOUT": Refusal(BadRollout, "rollout of task {task_id} refused: {message}"),
        "NOT_HOLDER": Refusal(NotTaskHolder, "rollout of task {task_id} from worker {worker_id} refused: {message}"),
        **_NO_STATE,
    },
)

CLAIM_STEP = LuaScript(
    name="claim_step",
    keys=("state", "counters", "requeue", "buffer", "rollout_retention"),
    argv=("now_ms", "groups_needed", "max_staleness", "record_ttl_s", "track", "final_version"),
    ok={"OK": ("step", "base_version", "rollouts_json", "claimed", "dropped")},
    fields={"NOT_READY": ("why", "dropped")},
    errors={"NOT_READY": Refusal(StepNotReady, "no step claimed: {why}", passed=("dropped",)), **_NO_STATE},
)

MARK_STEP_SENT = LuaScript(
    name="mark_step_sent",
    keys=("state", "counters"),
    argv=("now_ms", "step", "resend", "target"),
    ok={"OK": ()},
    errors={"NOT_CLAIMED": Refusal(StepNoLongerClaimed, "step {step} is no longer claimed"), **_NO_STATE},
)

PUBLISH_VERSION = LuaScript(
    name="publish_version",
    keys=("state", "counters", "versions", "rollout_retention"),
    argv=("now_ms", "version", "base_version", "step", "manifest_sha256", "worker_id", "record_ttl_s", "track"),
    # ALREADY: this worker already published this very manifest, and retries
    ok={"OK": _CURRENT, "ALREADY": _CURRENT},
    fields={"BAD_VERSION": _CURRENT, "CAS_LOST": _CURRENT, "STEP_NOT_CLAIMED": _CURRENT},
    errors={
        "BAD_VERSION": Refusal(BadVersionNumber, _PUBLISH_REFUSED, passed=_CURRENT),
        "CAS_LOST": Refusal(CasLost, _PUBLISH_REFUSED, passed=_CURRENT),
        "STEP_NOT_CLAIMED": Refusal(StepNotClaimed, _PUBLISH_REFUSED, passed=_CURRENT),
        **_NO_STATE,
    },
)

START_STEP = LuaScript(
    name="start_step",
    keys=("state",),
    argv=("now_ms", "step", "worker_id", "base_version", "task_ids_json", "incarnation"),
    ok={"OK": ()},
    errors={
        "NOT_CLAIMED": Refusal(
            StepNoLongerClaimed,
            "step {step} from v{base_version} is no longer claimed with this batch (published, or un-claimed and "
            "claimed again); drop this copy of the task",
        ),
        **_NO_STATE,
    },
)

FAIL_STEP = LuaScript(
    name="fail_step",
    keys=("state", "counters", "rejected_reasons", "buffer", "rollout_retention"),
    argv=("now_ms", "step", "worker_id", "kind", "reason", "task_id", "max_attempts", "record_ttl_s", "track"),
    # NOT_CLAIMED: published or un-claimed meanwhile; the report changes nothing and is answered as such
    ok={
        "OK": ("groups_rejected", "groups_requeued"),  # un-claimed
        "RETRY": ("attempts", "base_failed"),
        "NOT_CLAIMED": (),
    },
    errors={
        "NOT_IN_STEP": Refusal(BadStepFailure, "rollout {task_id} is not in the batch of step {step}"),
        **_NO_STATE,
    },
)

SET_HALT = LuaScript(name="set_halt", keys=("state",), argv=("reason", "by"), ok={"OK": ()}, errors=_NO_STATE)

CLEAR_HALT = LuaScript(name="clear_halt", keys=("state",), argv=("by",), ok={"OK": ("cleared",)})

_LEASE_FIELDS = ("version", "manifest_sha256", "expires_ms")

GRANT_LEASE = LuaScript(
    name="grant_lease",
    keys=("state", "counters", "leases", "versions"),
    argv=("now_ms", "ttl_ms", "lease_id", "worker_id", "task_id", "task_prefix", "incarnation"),
    ok={"OK": _LEASE_FIELDS},
    fields={"TASK_ENDED": ("task_state",)},
    errors={
        "NO_VERSION": Refusal(NoVersionYet, "run {run!r} has no published version yet; the init step is still running"),
        "TASK_ENDED": Refusal(
            TaskEnded,
            "task {task_id} is {task_state} (cancelled after a timeout, a lost worker or a reported failure, or "
            "already done): no lease; skip it, its prompts are handled",
        ),
        **_NO_STATE,
    },
)

RENEW_LEASE = LuaScript(
    name="renew_lease",
    keys=("state", "leases", "versions"),
    argv=("now_ms", "ttl_ms", "lease_id"),
    ok={"OK": _LEASE_FIELDS},
    errors={
        "LEASE_LOST": Refusal(
            LeaseLostError,
            "lease {lease_id} expired or is unknown; renew more often than async.lease_ttl_s ({ttl_ms} ms)",
        ),
        **_NO_STATE,
    },
)

RELEASE_LEASE = LuaScript(
    name="release_lease", keys=("counters", "leases"), argv=("lease_id",), ok={"OK": ("released",)}
)

EXPIRE_LEASES = LuaScript(name="expire_leases", keys=("counters", "leases"), argv=("now_ms",), ok={"OK": ("expired",)})

UNATTENDED_GROUPS = LuaScript(
    name="unattended_groups", keys=("tasks_inflight", "leases"), argv=("now_ms",), ok={"OK": ("groups", "tasks")}
)

RECORD_HEARTBEAT = LuaScript(
    name="record_heartbeat",
    keys=("workers", "workers_generate", "workers_optimize", "counters", "leases"),
    argv=("now_ms", "worker_id", "report_json", "forget_after_ms", "record_ttl_s", "role", "incarnation"),
    ok={"OK": ("forgotten", "restarted", "leases_ended")},
)

ADD_COUNTER = LuaScript(
    name="add_counter",
    keys=("state", "counters"),
    argv=("counter", "amount"),
    ok={"OK": ("value",)},
    errors=_NO_STATE,
)

# The two scripts of a rebuild itself: they must never start another one.
RESTORE_STATE = LuaScript(
    name="restore_state",
    keys=("state",),
    argv=("ops_json",),
    ok={"OK": ("applied",)},
    errors={"EXISTS": Refusal(StateExists, "run {run!r} already has a state in Redis")},
    rebuilds=False,
)

SNAPSHOT_JSON = LuaScript(
    name="snapshot_json",
    keys=(
        "state",
        "counters",
        "rejected_reasons",
        "versions",
        "requeue",
        "buffer",
        "tasks_inflight",
        "leases",
        "rollout_retention",
        "prompt_attempts",
        "tracking",
    ),
    argv=("header_json",),
    ok={"OK": ("document",)},
    errors={NO_STATE: Refusal(StateMissing, "Redis holds no state for run {run!r}")},
    rebuilds=False,
)

DUE_ROLLOUTS = LuaScript(
    name="due_rollouts",
    keys=("state", "rollout_retention"),
    argv=("max_version", "limit"),
    ok={"OK": ("due", "protected")},
    errors=_NO_STATE,
)

FORGET_ROLLOUTS = LuaScript(
    name="forget_rollouts",
    keys=("state", "counters", "rollout_retention"),
    argv=("max_version", "*task_ids"),
    ok={"OK": ("forgotten",)},
    errors=_NO_STATE,
)

ALL_SCRIPTS: tuple[LuaScript, ...] = (
    DISPATCH_GENERATE,
    CANCEL_TASKS,
    UNDO_DISPATCH,
    SUBMIT_ROLLOUT,
    CLAIM_STEP,
    MARK_STEP_SENT,
    START_STEP,
    FAIL_STEP,
    SET_HALT,
    CLEAR_HALT,
    PUBLISH_VERSION,
    GRANT_LEASE,
    RENEW_LEASE,
    RELEASE_LEASE,
    EXPIRE_LEASES,
    UNATTENDED_GROUPS,
    RECORD_HEARTBEAT,
    ADD_COUNTER,
    RESTORE_STATE,
    SNAPSHOT_JSON,
    DUE_ROLLOUTS,
    FORGET_ROLLOUTS,
    SCHEDULE_EVAL,
    GRANT_EVAL_LEASE,
    FINISH_EVAL_CHUNK,
    RETRY_EVALS,
    CLOSE_EVAL,
)


class Scripts:
    """Every script of one run, bound to the store's Redis client: ``scripts.grant_lease(now_ms=..., ...)``."""

    def __init__(self, bind: Callable[[LuaScript], BoundScript]) -> None:
        self.dispatch_generate = bind(DISPATCH_GENERATE)
        self.cancel_tasks = bind(CANCEL_TASKS)
        self.undo_dispatch = bind(UNDO_DISPATCH)
        self.submit_rollout = bind(SUBMIT_ROLLOUT)
        self.claim_step = bind(CLAIM_STEP)
        self.mark_step_sent = bind(MARK_STEP_SENT)
        self.start_step = bind(START_STEP)
        self.fail_step = bind(FAIL_STEP)
        self.set_halt = bind(SET_HALT)
        self.clear_halt = bind(CLEAR_HALT)
        self.publish_version = bind(PUBLISH_VERSION)
        self.grant_lease = bind(GRANT_LEASE)
        self.renew_lease = bind(RENEW_LEASE)
        self.release_lease = bind(RELEASE_LEASE)
        self.expire_leases = bind(EXPIRE_LEASES)
        self.unattended_groups = bind(UNATTENDED_GROUPS)
        self.record_heartbeat = bind(RECORD_HEARTBEAT)
        self.add_counter = bind(ADD_COUNTER)
        self.restore_state = bind(RESTORE_STATE)
        self.snapshot_json = bind(SNAPSHOT_JSON)
        self.due_rollouts = bind(DUE_ROLLOUTS)
        self.forget_rollouts = bind(FORGET_ROLLOUTS)
        self.schedule_eval = bind(SCHEDULE_EVAL)
        self.grant_eval_lease = bind(GRANT_EVAL_LEASE)
        self.finish_eval_chunk = bind(FINISH_EVAL_CHUNK)
        self.retry_evals = bind(RETRY_EVALS)
        self.close_eval = bind(CLOSE_EVAL)
