"""The coordinator's Lua scripts, declared: every change to a run's Redis state is one of these, so it is atomic.

The scripts are the files ``lua/<seam>/<name>.lua``; each starts with lines stating its KEYS, ARGV and return codes
(the one statement of them), and each declaration below adds which codes are answers and the exception of
every other one (how: below). A script returns a table whose first element is a code string; every code
that is not an answer maps to its own exception. Time is always passed in (``now_ms``) so that tests control
the clock; leases also get a real ``PEXPIRE`` as a backstop. Item keys (one per group, task, rollout, step,
lease, worker) are built inside the scripts as ``prefix .. kind .. ':' .. id`` with the kinds of
``proxy.coordinator.redis_store`` (``KEY_KINDS``) substituted in when the store binds the script.

Group states: ``inflight`` (in a generate task) -> ``buffered`` (admitted) -> ``claimed`` (in a step) ->
``trained``; or one of the other terminal states ``stale`` (requeued as a new group), ``rejected``
(bad input, with a reason) or ``cancelled`` (its task was lost; requeued). Terminal records expire after
``record_ttl_s`` so that Redis does not grow with the length of the run.

Rollout retention: when a rollout can never be trained (again) -- its step was published, or it was dropped as
stale, rejected, or its task was cancelled -- its task id goes into the ``rollout_retention`` sorted set,
scored with the version after which its bucket object may go (the version its step produced, else the
current one). Scripts that do so take a ``track`` argument: "0" (``async.rollout_retention_versions = -1``)
keeps every rollout and records nothing. DUE_ROLLOUTS and FORGET_ROLLOUTS serve the proxy's collection.

How a script is declared, loaded, registered and called (redis-py's ``Lock`` is the model).

A script lives in ``lua/<seam>/<name>.lua``, beside the coordinator module ``<seam>`` that runs it (read with
``importlib.resources``, so it works from an installed wheel), and starts with comment lines that state its
contract, in this form::

    -- <name>: what it does
    -- KEYS[1] <RunKeys attribute>  KEYS[2] ...
    -- ARGV[1] prefix  ARGV[2] <argument> <what it is>  ...  ARGV[n..] <argument> (the rest, a list)
    -- returns {"OK", <field>[:<type>], ...} | {"<CODE>", <field>, ...} (why) | ...

``lua/prelude.lua`` (the key helpers) is prepended at load time. The header is the one statement of the script's
KEYS (by ``RunKeys`` attribute (``keys``)), ARGV (by name) and reply fields, each with its type where it is not text
(``int``, ``json``, ``list``, ``rows``: ``FIELD_TYPES``), so a reply reaches its caller as typed values:
``LuaScript.contract`` parses it. The Python declaration (``scripts``) adds only what the header cannot say: which
codes are answers (``answers``) and, for every other code, the one exception of ``proxy.coordinator.scripts`` it
raises (``errors``). ``contract_problems`` finds every disagreement (a code neither answered nor mapped, a code
the body returns that the header omits, a refusal naming a value nobody has); a test runs it over every script.

Refusals: one exception per non-OK code (``CoordinatorError`` and its subclasses, below). The API maps each
refusal a worker can meet to an HTTP status and error code; the worker's client maps the code back to its own
exception, so a refusal keeps its meaning across the wire. The last group of them are answers the coordinator
handles itself (they never reach the API).

A call reads like a method: ``store.scripts.claim_step(now_ms=..., ...)``, or ``await scripts.grant_lease(...)``
on the event loop's client (``RedisStore.bind_loop``). The store passes the
key prefix (``ARGV[1]``) and the keys; the answer is a ``ScriptReply`` with the code and named fields.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from string import Template
from typing import Any

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import TimeoutError as RedisTimeoutError


# ---- refusals: one exception per non-OK code ----
class CoordinatorError(Exception):
    """Base of every refusal by the coordinator."""


class StateMissing(CoordinatorError):
    """Redis holds no state for the run (it was flushed or restarted empty); the run must be rebuilt."""


class NoVersionYet(CoordinatorError):
    """No version is published yet (the init step has not finished); nothing can be leased."""


class LeaseLostError(CoordinatorError):
    """The lease expired or never existed; the version it named may be collected."""


class TaskCancelled(CoordinatorError):
    """The generate task timed out or was superseded; its groups were already requeued."""


class UnknownTask(TaskCancelled):
    """The proxy never dispatched this task (or forgot it in a rebuild); its work is not wanted."""


class TaskEnded(TaskCancelled):
    """A lease asked for a generate task that is no longer in flight (cancelled, submitted, or forgotten):
    the worker skips the task and acks its message."""


class EvalEnded(TaskCancelled):
    """An eval task whose version is evaluated already or was given up (or an unknown one): the worker
    drops it."""


class BadRollout(CoordinatorError):
    """A submission that does not match its task (foreign or repeated groups, a future version, a bad key)."""


class NotTaskHolder(CoordinatorError):
    """A submission not bound to its lease: the task was never leased, another worker holds it, the version
    (or lease) is not one its holder leased for it, or another rollout was admitted for it. Nothing changed;
    the worker drops its work (the task is someone else's, or already done), reporting no failure."""


class StepNotFound(CoordinatorError):
    """No step with this number was claimed."""


class PublishConflict(CoordinatorError):
    """A publish that must not happen; the version is unchanged. Subclasses say why."""

    def __init__(self, message: str, current_version: int) -> None:
        super().__init__(message)
        self.current_version = current_version


class CasLost(PublishConflict):
    """``current != base_version``: another trainer published first (or this one is a zombie)."""


class BadVersionNumber(PublishConflict):
    """``version`` is not ``base_version + 1`` or ``step`` is not ``version``."""


class StepNotClaimed(PublishConflict):
    """No claimed step of this number starts from ``base_version``."""


class ManifestMissing(PublishConflict):
    """The version's MANIFEST.json is not in the bucket: the upload is incomplete."""


class ManifestMismatch(PublishConflict):
    """The manifest in the bucket is not the one the trainer says it wrote."""


class SnapshotFailed(CoordinatorError):
    """The snapshot could not be written to the bucket; the change is in Redis but not yet durable."""


class RolloutTooStale(CoordinatorError):
    """SUBMIT_ROLLOUT refused a rollout as too stale (its groups were requeued); the coordinator raises the
    protocol's ``StaleRolloutError`` in its place, which names the versions and the knob to change."""

    def __init__(self, message: str, current: int) -> None:
        super().__init__(message)
        self.current = int(current)


# ---- answers the coordinator handles itself ----


class BufferFull(CoordinatorError):
    """In-flight plus buffered groups would pass ``async.queue_maxsize``: no generate task now."""


class EpochMoved(CoordinatorError):
    """The prompt order position moved between reading it and dispatching; read it again."""


class StepNotReady(CoordinatorError):
    """No step can be claimed now (one is in flight, or too few groups are buffered)."""

    def __init__(self, message: str, dropped: int) -> None:
        super().__init__(message)
        self.dropped = int(dropped)
        """Groups dropped as too stale on the way (a change even though nothing was claimed)."""


class StepNoLongerClaimed(CoordinatorError):
    """The step was published (or forgotten) between reading it and marking its optimize task sent."""


class BadStepFailure(CoordinatorError):
    """A step failure report that does not match the step (it names a rollout outside the batch)."""


class StateExists(CoordinatorError):
    """A restore found the run's state already in Redis (another restore won); nothing was written."""


class VersionNotFound(StepNotFound):
    """No published version with this number is recorded (never published, or collected)."""


# ---- declaring, loading and calling a script ----
LUA_PACKAGE = "proxy.coordinator"
LUA_FOLDER = "lua"
PRELUDE = "prelude"
NO_STATE = "NO_STATE"
"""The code of every script that finds no state for the run (raised as ``StateMissing``)."""


@functools.cache
def lua_files() -> dict[str, Traversable]:
    """Every shipped script by name: ``lua/prelude.lua`` and ``lua/<seam>/<name>.lua``, each script in the folder
    of the one coordinator module that calls it."""
    root = resources.files(LUA_PACKAGE) / LUA_FOLDER
    files: dict[str, Traversable] = {}
    for entry in root.iterdir():
        for item in entry.iterdir() if entry.is_dir() else [entry]:
            if item.name.endswith(".lua"):
                name = item.name.removesuffix(".lua")
                if name in files:
                    raise RuntimeError(f"two Lua scripts are named {name!r}; rename one (names are global)")
                files[name] = item
    return files


@functools.cache
def lua_text(name: str) -> str:
    """The text of the script ``name`` as shipped in the package."""
    return lua_files()[name].read_text(encoding="utf-8")


def script_source(name: str, key_kinds: Mapping[str, str]) -> str:
    """The source sent to Redis: the prelude, with the store's key kinds (``${GROUP_KIND}``...) filled in, then
    the script."""
    return Template(lua_text(PRELUDE)).substitute(key_kinds) + "\n" + lua_text(name)


@dataclass(frozen=True)
class Refusal:
    """A non-OK code: the exception it raises and its message.

    The message is a ``str.format`` template over the call's ARGV names, the reply's fields, ``run`` and
    ``code``. ``passed`` are reply fields handed to the exception after the message (e.g. the current version
    of a refused publish).
    """

    error: type[CoordinatorError]
    message: str
    passed: tuple[str, ...] = ()


@dataclass(frozen=True)
class ScriptReply:
    """A script's answer: its code and its fields by the names of the file header."""

    code: str
    fields: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


_KEY = re.compile(r"KEYS\[(\d+)\] (\w+)")
_ARG = re.compile(r"ARGV\[(\d+)(\.\.)?\] (\w+)")
_CODE = re.compile(r'\{"([A-Z_]+)"((?:, *\w+(?::\w+)?)*)\}')
# codes the body can return: a literal first element of a returned table, or assigned to `code` first
_BODY_CODE = re.compile(r"(?:return \{|code = )'([A-Z_]+)'")


def _rows(packed: str) -> list[tuple[int, ...]]:
    """``"a:b:c,d:e:f"`` -> ``[(a, b, c), (d, e, f)]``: rows of numbers packed into one reply string."""
    return [tuple(int(part) for part in row.split(":")) for row in packed.split(",") if row]


FIELD_TYPES: dict[str, Callable[[Any], Any]] = {"int": int, "json": json.loads, "list": list, "rows": _rows}
"""What a typed reply field becomes: Lua answers text and integers; the header's type says which Python value
each field is, so callers read typed results, never parse a reply themselves."""


class ScriptHeaderError(ValueError):
    """A ``lua/<seam>/<name>.lua`` header that does not state a contract (misnumbered KEYS or ARGV)."""


@dataclass(frozen=True)
class ScriptContract:
    """What a script's file header states: the one source of its KEYS, ARGV and reply fields."""

    keys: tuple[str, ...]
    """``RunKeys`` attribute (``keys``) names, in KEYS order."""
    argv: tuple[str, ...]
    """ARGV names after ``prefix`` (ARGV[1]), in order; a last name starting with ``*`` takes a list."""
    codes: Mapping[str, tuple[str, ...]]
    """Every return code the header states, with its reply fields."""
    body_codes: frozenset[str]
    """The codes the body returns (a literal first element of a returned table)."""
    types: Mapping[str, str] = field(default_factory=dict)
    """The type a field's name carries in the header (``version:int``): one of ``FIELD_TYPES``; text if none."""


def parse_contract(text: str) -> ScriptContract:
    """The contract stated by a script's header (its leading ``--`` lines)."""
    lines = text.splitlines()
    count = next((i for i, line in enumerate(lines) if not line.startswith("--")), len(lines))
    head, body = lines[:count], "\n".join(lines[count:])
    keys: list[tuple[int, str]] = []
    argv: list[tuple[int, str]] = []
    returns: list[str] = []
    for line in head:
        keys += [(int(i), name) for i, name in _KEY.findall(line)]
        argv += [(int(i), ("*" if rest else "") + name) for i, rest, name in _ARG.findall(line)]
        if returns or line.startswith("-- returns "):
            returns.append(line)
    for found, what in ((keys, "KEYS"), (argv, "ARGV")):
        numbers = [i for i, _ in found]
        if numbers != list(range(1, len(found) + 1)):
            raise ScriptHeaderError(f"{what} numbered {numbers} in the header")
    if [name for _, name in argv[:1]] != ["prefix"]:
        raise ScriptHeaderError("ARGV[1] must be prefix")
    codes: dict[str, tuple[str, ...]] = {}
    types: dict[str, str] = {}
    for code, fields in _CODE.findall(" ".join(returns)):
        names = []
        for part in filter(None, (part.strip() for part in fields.split(","))):
            name, _, kind = part.partition(":")
            if kind and kind not in FIELD_TYPES:
                raise ScriptHeaderError(f"field {name} of {code} has type {kind!r}; use one of {sorted(FIELD_TYPES)}")
            if kind:
                types[name] = kind
            names.append(name)
        codes[code] = tuple(names)
    return ScriptContract(
        keys=tuple(name for _, name in keys),
        argv=tuple(name for _, name in argv[1:]),
        codes=codes,
        types=types,
        body_codes=frozenset(_BODY_CODE.findall(body)),
    )


@dataclass(frozen=True)
class LuaScript:
    """One script: its file ``lua/<seam>/<name>.lua`` states KEYS, ARGV and reply fields (``contract``); this adds
    which codes are answers and the exception of every other code."""

    name: str
    answers: tuple[str, ...] = ("OK",)
    """The codes that are answers; every other code is a refusal."""
    errors: Mapping[str, Refusal] = field(default_factory=dict)
    """Every other code, with the exception it raises."""

    @functools.cached_property
    def contract(self) -> ScriptContract:
        return parse_contract(lua_text(self.name))

    def args(self, values: Mapping[str, Any]) -> list[Any]:
        """The call's ARGV after the prefix, in the header's order; the names must match exactly."""
        argv = self.contract.argv
        names = [name.lstrip("*") for name in argv]
        if set(values) != set(names):
            raise TypeError(f"{self.name} takes {names}, got {sorted(values)}")
        out: list[Any] = []
        for name in argv:
            if name.startswith("*"):
                out.extend(values[name[1:]])
            else:
                out.append(values[name])
        return out

    def answer(self, reply: Sequence[Any], values: Mapping[str, Any], run: str) -> ScriptReply:
        """The reply as a ``ScriptReply``, or the mapped exception for a refusal."""
        code = reply[0]
        names = self.contract.codes.get(code, ())
        if len(reply) - 1 > len(names):
            raise RuntimeError(
                f"script {self.name} answered {code!r} with {len(reply) - 1} fields; its header states {list(names)}"
            )
        types = self.contract.types
        named = {
            name: FIELD_TYPES[types[name]](value) if name in types else value
            for name, value in zip(names, reply[1:], strict=False)
        }
        if code in self.answers:
            return ScriptReply(code, named)
        refusal = self.errors.get(code)
        if refusal is None:
            raise RuntimeError(f"script {self.name} answered {code!r}, which its declaration does not know")
        message = refusal.message.format_map({**values, **named, "run": run, "code": code})
        raise refusal.error(message, *(named[name] for name in refusal.passed))


def contract_problems(script: LuaScript, keys: type, text: str | None = None) -> list[str]:
    """Every way a declaration and its file disagree (empty when they agree): a code stated but neither an
    answer nor mapped to an exception, a code the body returns that the header does not state, a KEYS name
    that is not a ``RunKeys`` attribute (``keys``), a refusal message naming a value the call and reply do not have."""
    try:
        contract = parse_contract(text) if text is not None else script.contract
    except ScriptHeaderError as error:
        return [str(error)]
    problems = []
    for name in contract.keys:
        if not isinstance(getattr(keys, name, None), property):
            problems.append(f"KEYS: {name} is not a {keys.__name__} attribute")
    if any(name.startswith("*") for name in contract.argv[:-1]):
        problems.append("ARGV: only the last argument may take a list")
    answers, refused = set(script.answers), set(script.errors)
    if answers & refused:
        problems.append(f"codes both answers and errors: {sorted(answers & refused)}")
    if "OK" not in answers:
        problems.append("no OK answer declared")
    if set(contract.codes) != answers | refused:
        problems.append(f"codes: header {sorted(contract.codes)}, declared {sorted(answers | refused)}")
    if not contract.body_codes <= set(contract.codes):
        problems.append(
            f"codes the body returns but the header omits: {sorted(contract.body_codes - set(contract.codes))}"
        )
    if not set(contract.codes) <= contract.body_codes:
        problems.append(
            f"codes the header states but the body never returns: {sorted(set(contract.codes) - contract.body_codes)}"
        )
    names = {name.lstrip("*") for name in contract.argv} | {"run", "code"}
    for code, refusal in script.errors.items():
        problems += _refusal_problems(code, refusal, names | set(contract.codes.get(code, ())))
    return problems


def _refusal_problems(code: str, refusal: Refusal, names: set[str]) -> list[str]:
    problems = []
    error = refusal.error
    if not (issubclass(error, CoordinatorError) and error.__module__ == __name__):
        problems.append(f"{code} maps to {error!r}, not an exception of proxy.coordinator.scripts")
    used = {name for _, name, _, _ in string.Formatter().parse(refusal.message) if name}
    if not used <= names:
        problems.append(f"{code} message uses {sorted(used - names)}, which neither ARGV nor the reply has")
    if not set(refusal.passed) <= names:
        problems.append(f"{code} passes {list(refusal.passed)} to {error.__name__}, not all in its reply")
    return problems


class BoundScript:
    """A declaration bound to one Redis client and the run's keys: call it with the ARGV names."""

    def __init__(
        self,
        script: LuaScript,
        redis: Redis | AsyncRedis,
        source: str,
        keys: Callable[[str], str],
        prefix: str,
        run: str,
    ) -> None:
        self.script = script
        # registered once per client: redis-py sends EVALSHA and loads the source only when Redis lacks it
        self._registered: Any = redis.register_script(source)
        self._keys = [keys(name) for name in script.contract.keys]
        self._prefix = prefix
        self._run = run

    def __call__(self, **values: Any) -> ScriptReply:
        reply = self._registered(keys=self._keys, args=[self._prefix, *self.script.args(values)])
        return self.script.answer(reply, values, self._run)


ASYNC_CALL_TIMEOUT_S = 5.0
"""How long a script on an asyncio client waits for its reply before it fails with Redis's ``TimeoutError``."""


class AsyncBoundScript(BoundScript):
    """The same on an asyncio Redis client, for requests answered on the event loop: ``await script(...)``.

    The client should have no socket timeout of its own (``socket_timeout=None``): redis-py then writes through
    ``asyncio.wait_for``, a task per command (3 % of the proxy's CPU at 1,000 workers). The reply is bounded
    here instead, with one timer and no task."""

    async def __call__(self, **values: Any) -> ScriptReply:  # type: ignore[override]
        try:
            async with asyncio.timeout(ASYNC_CALL_TIMEOUT_S):
                reply = await self._registered(keys=self._keys, args=[self._prefix, *self.script.args(values)])
        except TimeoutError as error:  # redis-py dropped the connection it was using; the pool makes another
            raise RedisTimeoutError(f"{self.script.name}: no reply from Redis in {ASYNC_CALL_TIMEOUT_S} s") from error
        return self.script.answer(reply, values, self._run)


# Every script that reads the run's state refuses with NO_STATE when there is none: the coordinator rebuilds the
# state and calls again once (``Coordinator`` in ``service``).
_NO_STATE = {NO_STATE: Refusal(StateMissing, "Redis holds no state for run {run!r}")}
_PUBLISH_REFUSED = (
    "publish of v{version} from base v{base_version} (step {step}) refused ({code}): the current version is v{current}"
)
_CURRENT = ("current",)

_LEASE_FIELDS = ("version", "manifest_sha256", "expires_ms")

_EVAL_ENDED = Refusal(
    EvalEnded,
    "eval task {task_id} is not in flight (its version is evaluated already or was given up, or the task "
    "is unknown): drop it",
)


# ---- generate tasks (``generate_tasks``) ----

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

UNATTENDED_GROUPS = LuaScript(
    name="unattended_groups",
)


# ---- rollouts (``rollouts``) ----

SUBMIT_ROLLOUT = LuaScript(
    name="submit_rollout",
    answers=("OK", "DUPLICATE"),
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


# ---- steps and versions (``steps``) ----

CLAIM_STEP = LuaScript(
    name="claim_step",
    errors={"NOT_READY": Refusal(StepNotReady, "no step claimed: {why}", passed=("dropped",)), **_NO_STATE},
)

MARK_STEP_SENT = LuaScript(
    name="mark_step_sent",
    errors={"NOT_CLAIMED": Refusal(StepNoLongerClaimed, "step {step} is no longer claimed"), **_NO_STATE},
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
    answers=("OK", "RETRY", "NOT_CLAIMED"),
    errors={
        "NOT_IN_STEP": Refusal(BadStepFailure, "rollout {task_id} is not in the batch of step {step}"),
        **_NO_STATE,
    },
)

PUBLISH_VERSION = LuaScript(
    name="publish_version",
    answers=("OK", "ALREADY"),
    errors={
        "BAD_VERSION": Refusal(BadVersionNumber, _PUBLISH_REFUSED, passed=_CURRENT),
        "CAS_LOST": Refusal(CasLost, _PUBLISH_REFUSED, passed=_CURRENT),
        "STEP_NOT_CLAIMED": Refusal(StepNotClaimed, _PUBLISH_REFUSED, passed=_CURRENT),
        **_NO_STATE,
    },
)


# ---- leases and retention (``leases``) ----

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

DUE_ROLLOUTS = LuaScript(
    name="due_rollouts",
    errors=_NO_STATE,
)

FORGET_ROLLOUTS = LuaScript(
    name="forget_rollouts",
    errors=_NO_STATE,
)


# ---- evals (``evals``) ----

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
        "NOT_HOLDER": Refusal(NotTaskHolder, "result of eval task {task_id} from {worker_id} refused: {message}"),
    },
)

RETRY_EVALS = LuaScript(
    name="retry_evals",
)

CLOSE_EVAL = LuaScript(
    name="close_eval",
)


# ---- worker heartbeats (``service``) ----

RECORD_HEARTBEAT = LuaScript(
    name="record_heartbeat",
)


# ---- the store: counters and the halt (``redis_store``) ----

ADD_COUNTER = LuaScript(
    name="add_counter",
    errors=_NO_STATE,
)

SET_HALT = LuaScript(
    name="set_halt",
    errors=_NO_STATE,
)

CLEAR_HALT = LuaScript(
    name="clear_halt",
)

SET_LOGGED_FIELD = LuaScript(
    name="set_logged_field",
    errors=_NO_STATE,
)


# ---- the snapshot and the rebuild (``snapshot``, ``rebuild``): they must never start another rebuild ----

SNAPSHOT_JSON = LuaScript(
    name="snapshot_json",
    answers=("OK", "FENCED"),
    errors={NO_STATE: Refusal(StateMissing, "Redis holds no state for run {run!r}")},
)

LOG_SEGMENT = LuaScript(
    name="log_segment",
    answers=("OK", "COMPACT", "FENCED"),
    errors={NO_STATE: Refusal(StateMissing, "Redis holds no state for run {run!r}")},
)

RESTORE_STATE = LuaScript(
    name="restore_state",
    errors={"EXISTS": Refusal(StateExists, "run {run!r} already has a state in Redis")},
)


ALL_SCRIPTS: tuple[LuaScript, ...] = (
    DISPATCH_GENERATE,
    CANCEL_TASKS,
    UNDO_DISPATCH,
    UNATTENDED_GROUPS,
    SUBMIT_ROLLOUT,
    CLAIM_STEP,
    MARK_STEP_SENT,
    START_STEP,
    FAIL_STEP,
    PUBLISH_VERSION,
    GRANT_LEASE,
    RENEW_LEASE,
    RELEASE_LEASE,
    EXPIRE_LEASES,
    DUE_ROLLOUTS,
    FORGET_ROLLOUTS,
    SCHEDULE_EVAL,
    GRANT_EVAL_LEASE,
    FINISH_EVAL_CHUNK,
    RETRY_EVALS,
    CLOSE_EVAL,
    RECORD_HEARTBEAT,
    ADD_COUNTER,
    SET_HALT,
    CLEAR_HALT,
    SET_LOGGED_FIELD,
    SNAPSHOT_JSON,
    LOG_SEGMENT,
    RESTORE_STATE,
)


class Scripts:
    """The scripts of one run bound to the store's synchronous client (``scripts.claim_step(now_ms=..., ...)``):
    all but the fleet's five, which run on the event loop's client alone (``LoopScripts``)."""

    def __init__(self, bind: Callable[[LuaScript], BoundScript]) -> None:
        self.dispatch_generate = bind(DISPATCH_GENERATE)
        self.cancel_tasks = bind(CANCEL_TASKS)
        self.undo_dispatch = bind(UNDO_DISPATCH)
        self.unattended_groups = bind(UNATTENDED_GROUPS)
        self.claim_step = bind(CLAIM_STEP)
        self.mark_step_sent = bind(MARK_STEP_SENT)
        self.start_step = bind(START_STEP)
        self.fail_step = bind(FAIL_STEP)
        self.publish_version = bind(PUBLISH_VERSION)
        self.expire_leases = bind(EXPIRE_LEASES)
        self.due_rollouts = bind(DUE_ROLLOUTS)
        self.forget_rollouts = bind(FORGET_ROLLOUTS)
        self.schedule_eval = bind(SCHEDULE_EVAL)
        self.grant_eval_lease = bind(GRANT_EVAL_LEASE)
        self.finish_eval_chunk = bind(FINISH_EVAL_CHUNK)
        self.retry_evals = bind(RETRY_EVALS)
        self.close_eval = bind(CLOSE_EVAL)
        self.add_counter = bind(ADD_COUNTER)
        self.set_halt = bind(SET_HALT)
        self.clear_halt = bind(CLEAR_HALT)
        self.set_logged_field = bind(SET_LOGGED_FIELD)
        self.snapshot_json = bind(SNAPSHOT_JSON)
        self.log_segment = bind(LOG_SEGMENT)
        self.restore_state = bind(RESTORE_STATE)
