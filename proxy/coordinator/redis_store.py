"""The store of one run's coordinator state: the Redis client, the key names, the clock and the scripts.

Every module of the coordinator reaches Redis through a ``RedisStore``. It owns what they share: the client
(made with ``decode_responses=True``), ``RunKeys``, the injectable clock in milliseconds (by default Redis
``TIME``, so every proxy and host agrees on deadlines, read once a second and extrapolated in between:
``RedisClock``; tests pass their own, so no test sleeps), how long
finished records stay (``record_ttl_s``), the scripts bound to this client, and
a change counter that tells the snapshot writer whether anything changed since the last snapshot.

A script that finds no state for the run (Redis was flushed or restarted empty) raises ``StateMissing``; the
coordinator's entry points (``service.Coordinator``) then rebuild the state from the bucket and call again.

The run's halt (``halt``, ``clear_halt``, ``halted_reason``) is a reason string in the state hash that stops
steps from being claimed or sent: a fault no worker can get past on its own (every live trainer failed to load
the base version of the step in flight, or the current version is corrupted). The run waits, visibly, for an
operator instead of re-sending a step that cannot succeed: ``/v1/status`` and ``asyncgrpo status`` show the
reason, the ``asyncgrpo_run_halted`` gauge is 1 and the ``AsyncgrpoRunHalted`` alert fires. Each halt names
its source (``by``), so a source clears only its own halt once the cause is gone; generation goes on meanwhile.

Key names (``RunKeys``): every Redis key of the coordinator is named here, and nowhere else.

All keys of one run share the prefix ``asyncgrpo:{<run>}:``. The braces are a Redis Cluster hash tag: every
key of a run lands in one slot, so a Lua script may touch any of them. Keys built inside Lua scripts (one
per group, task, rollout, lease, step or worker) are ``prefix + kind + ":" + id``; the kinds are the
``*_KIND`` constants below, which the store fills into the scripts' prelude (``KEY_KINDS``) so that the names
still come from this module.

Fixed keys:

- ``state``      hash: current_version, step_inflight, epoch, epoch_pos, task_seq, incarnation, ...
- ``counters``   hash: monotonic totals (admitted, stale, rejected, cancelled, trained, publish, ...)
- ``rejected_reasons`` hash: reason -> groups rejected for it
- ``versions``   hash: version -> manifest sha256 of each published version
- ``requeue``    list: prompt indices put back in line (served before the permutation)
- ``buffer``     list: task ids of admitted rollouts not yet claimed, oldest first
- ``tasks_inflight`` sorted set: generate task id -> deadline (ms)
- ``leases``     sorted set: lease id -> expiry (ms)
- ``workers``    sorted set: worker id -> last heartbeat (ms)
- ``workers_generate``, ``workers_optimize`` sorted sets: the same, per role, so ``/metrics`` counts the
  live workers of a role with one ZCOUNT
- ``rollout_retention`` sorted set: task id -> the version after which its rollout object may be deleted
  from the bucket (trained, stale, rejected or cancelled; never a buffered or claimed one)
- ``proxy_lease`` string (JSON, with a TTL; ``RunKeys.proxy_leadership``): the proxy's leadership, the one live
  proxy of the run and its fencing epoch
- ``proxy_epoch`` counter: the last fencing epoch handed out (``proxy.coordinator.snapshot``)
- ``prompt_attempts`` hash: prompt index -> failed attempts of its group since it last ran to a submission
  (and ``reason:<index>`` -> the last failure its worker reported); at ``async.max_group_attempts`` the
  group is rejected and ``quarantined:<index>`` -> the reason keeps the prompt from being dispatched again
  (``quarantined`` counts them)
- ``tracking``   hash: what the proxy sent to each experiment tracker (``proxy.tracking.forwarder``):
  ``<tracker>:step`` -> the last step record sent, ``<tracker>:eval:<version>`` -> when that eval was sent
  (unix seconds; a rebuild writes its own time); the snapshot carries it, compacted to the cursor and the
  sorted versions per tracker (``tracking_step_field`` / ``tracking_eval_field`` name the fields)
- ``evals``      hash ([eval], ``proxy.coordinator.evals``): ``cursor`` (the next version to consider),
  ``latest`` (JSON of the newest eval summary) and ``latest_version``; per due version not yet recorded
  ``v:<version>`` (JSON: chunks left, task ids); per eval task in flight ``t:<task_id>`` (JSON: version,
  prompt range, attempts, worker) and, once its result came, ``s:<task_id>`` (its chunk summary)
- ``evals_inflight`` sorted set: eval task id -> deadline (ms)
- ``log``        hash ([the snapshot log](``proxy.coordinator.snapshot_log``)): ``seq`` (the last log sequence
  number handed out) and ``through`` (the number the last compaction covers; absent until the first compaction
  since the state was built, so a rebuilt state is compacted before any segment is written)
- ``log_dirty``  set: what script writes touched since the last segment (``lua/prelude.lua``'s ``call()``)
- ``log_ops``    list: the writes to the logged lists since the last segment, in order
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from asyncgrpo.bucket.layout import check_run_name
from proxy.coordinator.scripts import (
    GRANT_LEASE,
    RECORD_HEARTBEAT,
    RELEASE_LEASE,
    RENEW_LEASE,
    SUBMIT_ROLLOUT,
    AsyncBoundScript,
    BoundScript,
    LuaScript,
    Scripts,
    script_source,
)

# ---- every Redis key name of a run ----
GROUP_KIND = "group"
TASK_KIND = "task"
ROLLOUT_KIND = "rollout"
LEASE_KIND = "lease"
STEP_KIND = "step"
WORKER_KIND = "worker"
KEY_KINDS = {
    "GROUP_KIND": GROUP_KIND,
    "TASK_KIND": TASK_KIND,
    "ROLLOUT_KIND": ROLLOUT_KIND,
    "LEASE_KIND": LEASE_KIND,
    "STEP_KIND": STEP_KIND,
    "WORKER_KIND": WORKER_KIND,
}
"""The kinds as ``lua/prelude.lua`` names them: the scripts build item keys with these very names."""

LOGGED_KEYS: dict[str, str] = {
    "state": "hash",
    "counters": "hash",
    "rejected_reasons": "hash",
    "versions": "hash",
    "prompt_attempts": "hash",
    "tracking": "hash",
    "requeue": "list",
    "buffer": "list",
    "tasks_inflight": "zset",
    "leases": "zset",
    "rollout_retention": "zset",
}
"""The fixed keys the snapshot holds (``RunKeys`` attribute -> shape): every script write to one of them, and to
a group, task, rollout, lease or step record, is noted for the snapshot log (``call()`` in ``lua/prelude.lua``;
``proxy.coordinator.snapshot_log``)."""


@functools.cache
def prelude_names() -> dict[str, str]:
    """What ``lua/prelude.lua`` gets filled in with: the item kinds, the log's key names and the logged keys."""
    keys = RunKeys("names")
    suffix = {name: getattr(keys, name).removeprefix(keys.prefix) for name in (*LOGGED_KEYS, "log_dirty", "log_ops")}
    logged = ", ".join(f"['{suffix[name]}'] = {{'{name}', '{shape}'}}" for name, shape in LOGGED_KEYS.items())
    log_names = {"LOG_DIRTY_NAME": suffix["log_dirty"], "LOG_OPS_NAME": suffix["log_ops"]}
    return {**KEY_KINDS, **log_names, "LOGGED_KEYS": logged}


def tracking_step_field(tracker: str) -> str:
    """The ``tracking`` hash field holding the last step sent to ``tracker``."""
    return f"{tracker}:step"


def tracking_eval_field(tracker: str, version: int) -> str:
    """The ``tracking`` hash field marking the eval of ``version`` as sent to ``tracker``."""
    return tracking_eval_prefix(tracker) + str(version)


def tracking_eval_prefix(tracker: str) -> str:
    """What every eval field of ``tracker`` starts with (the version follows)."""
    return f"{tracker}:eval:"


@dataclass(frozen=True)
class RunKeys:
    """The Redis key names of one run."""

    run: str

    def __post_init__(self) -> None:
        check_run_name(self.run)

    @property
    def prefix(self) -> str:
        return f"asyncgrpo:{{{self.run}}}:"

    @property
    def pattern(self) -> str:
        """A SCAN/KEYS pattern matching every key of the run (braces escaped for glob)."""
        return f"asyncgrpo:\\{{{self.run}\\}}:*"

    @property
    def state(self) -> str:
        return self.prefix + "state"

    @property
    def counters(self) -> str:
        return self.prefix + "counters"

    @property
    def rejected_reasons(self) -> str:
        return self.prefix + "rejected_reasons"

    @property
    def versions(self) -> str:
        return self.prefix + "versions"

    @property
    def requeue(self) -> str:
        return self.prefix + "requeue"

    @property
    def buffer(self) -> str:
        return self.prefix + "buffer"

    @property
    def tasks_inflight(self) -> str:
        return self.prefix + "tasks_inflight"

    @property
    def leases(self) -> str:
        return self.prefix + "leases"

    @property
    def workers(self) -> str:
        return self.prefix + "workers"

    @property
    def workers_generate(self) -> str:
        return self.prefix + "workers_generate"

    @property
    def workers_optimize(self) -> str:
        return self.prefix + "workers_optimize"

    @property
    def rollout_retention(self) -> str:
        return self.prefix + "rollout_retention"

    @property
    def proxy_leadership(self) -> str:
        # The key keeps its first name: a running deployment holds it, and a renamed one would let two proxies lead.
        return self.prefix + "proxy_lease"

    @property
    def proxy_epoch(self) -> str:
        return self.prefix + "proxy_epoch"

    @property
    def prompt_attempts(self) -> str:
        return self.prefix + "prompt_attempts"

    @property
    def tracking(self) -> str:
        return self.prefix + "tracking"

    @property
    def evals(self) -> str:
        return self.prefix + "evals"

    @property
    def evals_inflight(self) -> str:
        return self.prefix + "evals_inflight"

    @property
    def log(self) -> str:
        return self.prefix + "log"

    @property
    def log_dirty(self) -> str:
        return self.prefix + "log_dirty"

    @property
    def log_ops(self) -> str:
        return self.prefix + "log_ops"

    def _item(self, kind: str, item_id: str | int) -> str:
        return f"{self.prefix}{kind}:{item_id}"

    def group(self, group_id: str) -> str:
        return self._item(GROUP_KIND, group_id)

    def task(self, task_id: str) -> str:
        return self._item(TASK_KIND, task_id)

    def rollout(self, task_id: str) -> str:
        return self._item(ROLLOUT_KIND, task_id)

    def lease(self, lease_id: str) -> str:
        return self._item(LEASE_KIND, lease_id)

    def step(self, step: int) -> str:
        return self._item(STEP_KIND, step)

    def worker(self, worker_id: str) -> str:
        return self._item(WORKER_KIND, worker_id)


# ---- the store ----

RECORD_TTL_S = 7 * 24 * 3600
"""Finished group/task/rollout/step records stay this long in Redis (for inspection), then expire."""

log = structlog.get_logger()


def wall_clock_ms(redis: Redis) -> int:
    """Now in milliseconds by Redis ``TIME``: deadlines written by one proxy mean the same to the next one,
    whatever the skew between their hosts' clocks."""
    seconds, micros = redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


CLOCK_RESYNC_S = 1.0
"""How long ``RedisClock`` extrapolates one ``TIME`` reading with this host's monotonic clock."""


class RedisClock:
    """Redis ``TIME`` in milliseconds, read at most once per ``resync_s`` and extrapolated in between with this
    host's monotonic clock. A round trip per reading was about ten per lease + submit cycle and 9 % of the
    proxy's Python CPU (``benchmarks/bench_proxy_scale.py --py-spy``). Between two readings the error is the
    monotonic clock's drift over one interval (microseconds) plus the reading's reply latency, which a round
    trip per call had too. Never goes backwards, whatever a new reading says."""

    def __init__(
        self, redis: Redis, resync_s: float = CLOCK_RESYNC_S, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.redis = redis
        self.resync_s = resync_s
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._reading: tuple[int, float] | None = None  # (Redis ms, monotonic seconds when read)
        self._last = 0

    def __call__(self) -> int:
        with self._lock:
            now = self.monotonic()
            if self._reading is None or now - self._reading[1] >= self.resync_s:
                self._reading = (wall_clock_ms(self.redis), self.monotonic())
                now = self._reading[1]
            redis_ms, read_at = self._reading
            self._last = max(self._last, redis_ms + round((now - read_at) * 1000))
            return self._last


@dataclass(frozen=True)
class LoopScripts:
    """The scripts of the fleet's requests (``proxy.coordinator.fleet``), bound to an event loop's asyncio
    client, and the client (a submit with rejected groups reads the known reasons)."""

    redis: AsyncRedis
    record_heartbeat: AsyncBoundScript
    grant_lease: AsyncBoundScript
    renew_lease: AsyncBoundScript
    release_lease: AsyncBoundScript
    submit_rollout: AsyncBoundScript


class RedisStore:
    """Redis, keys, clock and scripts of one run."""

    def __init__(
        self,
        redis: Redis,
        run: str,
        *,
        clock_ms: Callable[[], int] | None = None,
        record_ttl_s: int = RECORD_TTL_S,
    ) -> None:
        if not redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("the coordinator needs a Redis client made with decode_responses=True")
        self.redis = redis
        self.run = run
        self.keys = RunKeys(run)
        self.clock_ms = clock_ms if clock_ms is not None else RedisClock(redis)
        self.record_ttl_s = record_ttl_s
        self.scripts = Scripts(self._bind)
        self._changes_lock = threading.Lock()
        self._changes = 0

    def _bind(self, script: LuaScript) -> BoundScript:
        return BoundScript(
            script,
            self.redis,
            script_source(script.name, prelude_names()),
            lambda name: getattr(self.keys, name),
            self.keys.prefix,
            self.run,
        )

    def bind_async(self, redis: AsyncRedis, script: LuaScript) -> AsyncBoundScript:
        """``script`` on an asyncio client of this store's Redis (``redis``: the caller's, on its event loop)."""
        source = script_source(script.name, prelude_names())
        keys = self.keys
        return AsyncBoundScript(script, redis, source, lambda name: getattr(keys, name), keys.prefix, self.run)

    def bind_loop(self, redis: AsyncRedis) -> LoopScripts:
        """The scripts of the fleet's requests, on an event loop's asyncio client ``redis``."""
        return LoopScripts(
            redis=redis,
            record_heartbeat=self.bind_async(redis, RECORD_HEARTBEAT),
            grant_lease=self.bind_async(redis, GRANT_LEASE),
            renew_lease=self.bind_async(redis, RENEW_LEASE),
            release_lease=self.bind_async(redis, RELEASE_LEASE),
            submit_rollout=self.bind_async(redis, SUBMIT_ROLLOUT),
        )

    def write_logged_field(self, section: str, field: str, value: str | int | None) -> None:
        """Set (or, with None, delete) one field of a logged hash from Python, noted for the snapshot log as a
        script's ``call()`` notes it (``lua/prelude.lua``). Refused with ``StateMissing`` while Redis holds no
        state for the run: a write into an emptied Redis would leave a partial state behind."""
        if LOGGED_KEYS.get(section) != "hash":
            raise ValueError(f"{section!r} is not a hash the snapshot log holds ({sorted(LOGGED_KEYS)})")
        name = getattr(self.keys, section).removeprefix(self.keys.prefix)
        op, text = ("del", "") if value is None else ("set", str(value))
        self.scripts.set_logged_field(section=name, field=field, op=op, value=text)

    def has_state(self) -> bool:
        return bool(self.redis.exists(self.keys.state))

    def current_version(self) -> int:
        value = self.redis.hget(self.keys.state, "current_version")
        return -1 if value is None else int(value)

    def count(self, counter: str, amount: int = 1) -> None:
        """Add to a counter of ``/v1/status`` an event decided outside Redis."""
        self.scripts.add_counter(counter=counter, amount=amount)

    def mark_changed(self) -> int:
        """Something the snapshot holds changed (call it after the change): returns the change's number, which
        ``SnapshotWriter.write_through`` makes durable."""
        with self._changes_lock:
            self._changes += 1
            return self._changes

    @property
    def changes(self) -> int:
        with self._changes_lock:
            return self._changes


HALTED_FIELD = "halted"
HALTED_BY_FIELD = "halted_by"


def halted_reason(store: RedisStore) -> str | None:
    """The reason the run is halted, or None when it is not."""
    return store.redis.hget(store.keys.state, HALTED_FIELD) or None


def halt(store: RedisStore, reason: str, *, by: str) -> None:
    """Halt the run's steps with ``reason`` (a sentence naming what to fix); ``by`` names the source.

    Logged (at error level) once per new reason: sources re-assert their halt on every check."""
    if halted_reason(store) == reason:
        return
    store.scripts.set_halt(reason=reason, by=by)
    store.mark_changed()
    log.error("proxy.run_halted", reason=reason, by=by)


def clear_halt(store: RedisStore, *, by: str) -> bool:
    """Lift a halt set by ``by`` (another source's halt stays); True if one was lifted."""
    lifted = store.scripts.clear_halt(by=by)["cleared"] > 0
    if lifted:
        store.mark_changed()
        log.warning("proxy.run_halt_cleared", by=by)
    return lifted
