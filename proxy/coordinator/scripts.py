"""The coordinator's Lua scripts, declared: every change to a run's Redis state is one of these, so it is atomic.

The scripts are the files ``lua/<name>.lua``; each starts with lines stating its KEYS, ARGV and return codes
(the one statement of them), and each declaration below adds which codes are answers and the exception of
every other one (``proxy.coordinator.lua_script`` says how). A script returns a
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
    EvalEnded,
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
from proxy.coordinator.lua_script import NO_STATE, BoundScript, LuaScript, Refusal

# Every script that reads the run's state refuses with NO_STATE when there is none: the coordinator rebuilds the
# state and calls again once (``Coordinator`` in ``service``).
_NO_STATE = {NO_STATE: Refusal(StateMissing, "Redis holds no state for run {run!r}")}
_PUBLISH_REFUSED = (
    "publish of v{version} from base v{base_version} (step {step}) refused ({code}): the current version is v{current}"
)
_CURRENT = ("current",)

DISPATCH_GENERATE = LuaScript(
    name="dispatch_generate",
    errors={
        "NO_ROOM": Refusal(BufferFull, "run {run!r}: the buffer has no room for {groups_per_task} more groups"),
        "RETRY": Refusal(EpochMoved, "run {run!r}: the prompt order moved past epoch {epoch} position {epoch_pos}"),
        **_NO_STATE,
    },
)

CANCEL_TASKS = LuaScript(
    name="cancel_tasks",
    errors=_NO_STATE,
)

UNDO_DISPATCH = LuaScript(
    name="undo_dispatch",
    errors=_NO_STATE,
)

SUBMIT_ROLLOUT = LuaScript(
    name="submit_rollout",
    answers=('OK', 'DUPLICATE'),
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
    errors={"NOT_READY": Refusal(StepNotReady, "no step claimed: {why}", passed=("dropped",)), **_NO_STATE},
)

MARK_STEP_SENT = LuaScript(
    name="mark_step_sent",
    errors={"NOT_CLAIMED": Refusal(StepNoLongerClaimed, "step {step} is no longer claimed"), **_NO_STATE},
)

PUBLISH_VERSION = LuaScript(
    name="publish_version",
    answers=('OK', 'ALREADY'),
    errors={
        "BAD_VERSION": Refusal(BadVersionNumber, _PUBLISH_REFUSED, passed=_CURRENT),
        "CAS_LOST": Refusal(CasLost, _PUBLISH_REFUSED, passed=_CURRENT),
        "STEP_NOT_CLAIMED": Refusal(StepNotClaimed, _PUBLISH_REFUSED, passed=_CURRENT),
        **_NO_STATE,
    },
)

START_STEP = LuaScript(
    name="start_step",
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
    answers=('OK', 'RETRY', 'NOT_CLAIMED'),
    errors={
        "NOT_IN_STEP": Refusal(BadStepFailure, "rollout {task_id} is not in the batch of step {step}"),
        **_NO_STATE,
    },
)

SET_HALT = LuaScript(
    name="set_halt",
    errors=_NO_STATE,
)

CLEAR_HALT = LuaScript(
    name="clear_halt",
)

_LEASE_FIELDS = ("version", "manifest_sha256", "expires_ms")

GRANT_LEASE = LuaScript(
    name="grant_lease",
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
    errors={
        "LEASE_LOST": Refusal(
            LeaseLostError,
            "lease {lease_id} expired or is unknown; renew more often than async.lease_ttl_s ({ttl_ms} ms)",
        ),
        **_NO_STATE,
    },
)

RELEASE_LEASE = LuaScript(
    name="release_lease",
)

EXPIRE_LEASES = LuaScript(
    name="expire_leases",
)

UNATTENDED_GROUPS = LuaScript(
    name="unattended_groups",
)

RECORD_HEARTBEAT = LuaScript(
    name="record_heartbeat",
)

ADD_COUNTER = LuaScript(
    name="add_counter",
    errors=_NO_STATE,
)

# The two scripts of a rebuild itself: they must never start another one.
RESTORE_STATE = LuaScript(
    name="restore_state",
    errors={"EXISTS": Refusal(StateExists, "run {run!r} already has a state in Redis")},
)

SNAPSHOT_JSON = LuaScript(
    name="snapshot_json",
    errors={NO_STATE: Refusal(StateMissing, "Redis holds no state for run {run!r}")},
)

DUE_ROLLOUTS = LuaScript(
    name="due_rollouts",
    errors=_NO_STATE,
)

FORGET_ROLLOUTS = LuaScript(
    name="forget_rollouts",
    errors=_NO_STATE,
)

# ---- evaluations (``proxy.coordinator.evaluations``) ----

_EVAL_ENDED = Refusal(
    EvalEnded,
    "evaluate task {task_id} is not in flight (its version is evaluated already or was given up, or the task "
    "is unknown): drop it",
)

SCHEDULE_EVAL = LuaScript(
    name="schedule_eval",
    errors=_NO_STATE,
)

GRANT_EVAL_LEASE = LuaScript(
    name="grant_eval_lease",
    errors={"EVAL_ENDED": _EVAL_ENDED, **_NO_STATE},
)

FINISH_EVAL_CHUNK = LuaScript(
    name="finish_eval_chunk",
    errors={
        "EVAL_ENDED": _EVAL_ENDED,
        "NOT_HOLDER": Refusal(NotTaskHolder, "result of evaluate task {task_id} from {worker_id} refused: {message}"),
    },
)

RETRY_EVALS = LuaScript(
    name="retry_evals",
)

CLOSE_EVAL = LuaScript(
    name="close_eval",
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
