"""The Lua scripts of evaluation during training (``[eval]``), declared like those of ``scripts``.

They live in ``lua/`` with the others and are part of ``scripts.ALL_SCRIPTS``; ``proxy.coordinator.evaluations``
calls them. Their state is the ``evals`` hash and the ``evals_inflight`` sorted set of ``redis_keys``; an eval
lease is an ordinary lease (``leases`` and a lease hash naming the evaluated version), so GC keeps the version
and ``/v1/leases/{lease_id}/renew`` renews it.
"""

from __future__ import annotations

from proxy.coordinator.errors import EvalEnded, NotTaskHolder, StateMissing
from proxy.coordinator.lua_script import NO_STATE, LuaScript, Refusal

_NO_STATE = {NO_STATE: Refusal(StateMissing, "Redis holds no state for run {run!r} even after a rebuild")}
_EVAL_ENDED = Refusal(
    EvalEnded,
    "evaluate task {task_id} is not in flight (its version is evaluated already or was given up, or the task "
    "is unknown): drop it",
)

SCHEDULE_EVAL = LuaScript(
    name="schedule_eval",
    keys=("state", "counters", "evals", "evals_inflight"),
    argv=("deadline_ms", "version", "cursor", "*tasks"),
    ok={"OK": ("scheduled",)},
    errors=_NO_STATE,
)

GRANT_EVAL_LEASE = LuaScript(
    name="grant_eval_lease",
    keys=("state", "counters", "leases", "versions", "evals", "evals_inflight"),
    argv=("now_ms", "ttl_ms", "lease_id", "worker_id", "task_id", "deadline_ms", "incarnation"),
    ok={"OK": ("version", "manifest_sha256", "expires_ms", "prompt_start", "prompt_count")},
    errors={"EVAL_ENDED": _EVAL_ENDED, **_NO_STATE},
)

FINISH_EVAL_CHUNK = LuaScript(
    name="finish_eval_chunk",
    keys=("counters", "leases", "evals", "evals_inflight"),
    argv=("task_id", "lease_id", "summary_json", "worker_id"),
    ok={"OK": ("version", "chunks_left")},
    fields={"NOT_HOLDER": ("message",)},
    errors={
        "EVAL_ENDED": _EVAL_ENDED,
        "NOT_HOLDER": Refusal(NotTaskHolder, "result of evaluate task {task_id} from {worker_id} refused: {message}"),
    },
)

RETRY_EVALS = LuaScript(
    name="retry_evals",
    keys=("counters", "evals", "evals_inflight", "workers"),
    argv=("now_ms", "alive_since_ms", "deadline_ms", "max_attempts"),
    ok={"OK": ("resend_json", "failed_json")},
)

CLOSE_EVAL = LuaScript(
    name="close_eval",
    keys=("counters", "evals"),
    argv=("version", "summary_json"),
    ok={"OK": ("closed",)},
)

