"""The coordinator: a run's live state in Redis, changed only by the Lua scripts of ``proxy.coordinator.scripts``.

One ``Coordinator`` serves one run. The HTTP layer (``proxy.api.app``) calls its request methods
(``lease``, ``renew``, ``release``, ``submit``, ``get_step``, ``publish``, ``heartbeat``); a background loop
calls ``tick()`` which expires leases and lost tasks, claims a step, keeps the generate queue fed, re-sends
timed-out steps, writes the snapshot and garbage-collects old versions and rollout objects past their
retention. Tests call ``tick()`` directly and pass their own clock (milliseconds), so no test sleeps.

The rules it enforces are the invariants 1-4 and 6 of README.md: versions move by CAS ``N -> N+1`` only;
nothing staler than ``async.max_staleness`` is admitted or claimed; versions under a live lease or in the
staleness window are kept; every dispatched group ends exactly once (trained, stale, rejected or
cancelled) and the prompt of a stale or cancelled one goes back in line; an empty Redis is rebuilt from the
bucket (``proxy.coordinator.snapshot``).
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from redis import Redis
from redis.commands.core import Script

from proxy.coordinator import scripts as lua_scripts
from proxy.coordinator.dispatch import Dispatcher, DispatchError
from proxy.coordinator.errors import (
    PUBLISH_CONFLICTS,
    BadRollout,
    LeaseLostError,
    ManifestMismatch,
    ManifestMissing,
    NoVersionYet,
    SnapshotFailed,
    StateMissing,
    StepNotFound,
    TaskCancelled,
    UnknownTask,
)
from proxy.coordinator.metrics import ProxyMetrics, RunLimits
from proxy.coordinator.redis_keys import RunKeys
from proxy.protocol.schemas import (
    GenerateTaskMessage,
    GroupRef,
    HeartbeatRequest,
    LeaseGrant,
    LeaseRecord,
    OptimizeTaskMessage,
    PublishRequest,
    PublishResult,
    RolloutRef,
    RolloutSubmission,
    RunInfo,
    StatusResponse,
    StepBatch,
    SubmitResult,
    WorkerRecord,
)
from proxy.protocol.staleness import StaleRolloutError
from proxy.run.config import RunConfig
from proxy.storage import bucket_keys
from proxy.storage.bucket import Bucket, BucketError, ObjectNotFound
from proxy.storage.manifest import IntegrityError, delete_version, list_versions, read_manifest

log = structlog.get_logger()

RECORD_TTL_S = 7 * 24 * 3600
"""Finished group/task/rollout/step records stay this long in Redis (for inspection), then expire."""
MAX_REJECT_REASONS = 32
"""Distinct rejection reasons kept as metric labels; further ones are counted as 'other'."""
OMITTED_GROUP_REASON = "missing_from_rollout"
WORKER_FORGET_S = 3600.0
"""A worker silent this long disappears from ``/v1/workers``."""
MAX_TASKS_PER_TICK = 256
MAX_ROLLOUT_DELETES_PER_TICK = 256
"""Rollout objects deleted by one tick at most; the rest wait for the next (a tick must stay short)."""


def normalise_reason(reason: str) -> str:
    """A rejection reason as a bounded metric label: lower-case ``[a-z0-9_]``, at most 40 characters."""
    label = re.sub(r"[^a-z0-9_]+", "_", reason.strip().lower()).strip("_")[:40]
    return label or "unspecified"


@dataclass
class TickReport:
    """What one ``tick()`` did; returned for tests and logged when anything happened."""

    leases_expired: int = 0
    tasks_cancelled: int = 0
    stale_dropped: int = 0
    step_claimed: int | None = None
    step_sent: int | None = None
    tasks_sent: list[str] = field(default_factory=list)
    versions_deleted: list[int] = field(default_factory=list)
    rollouts_deleted: list[str] = field(default_factory=list)
    rebuilt: str | None = None

    def busy(self) -> bool:
        return any(
            (
                self.leases_expired,
                self.tasks_cancelled,
                self.stale_dropped,
                self.step_claimed is not None,
                self.step_sent is not None,
                self.tasks_sent,
                self.versions_deleted,
                self.rollouts_deleted,
                self.rebuilt,
            )
        )


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


class Coordinator:
    """The state operations of one run. ``redis`` must be created with ``decode_responses=True``."""

    def __init__(
        self,
        redis: Redis,
        bucket: Bucket,
        run: str,
        config: RunConfig,
        num_prompts: int,
        dispatcher: Dispatcher,
        *,
        config_sha256: str = "",
        prompts_sha256: str = "",
        clock_ms: Callable[[], int] = wall_clock_ms,
        metrics: ProxyMetrics | None = None,
        worker_alive_s: float = 30.0,
        record_ttl_s: int = RECORD_TTL_S,
    ) -> None:
        if not redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("the coordinator needs a Redis client made with decode_responses=True")
        if num_prompts < 1:
            raise ValueError(f"the run has {num_prompts} prompts; it needs at least one")
        self.redis = redis
        self.bucket = bucket
        self.run = run
        self.keys = RunKeys(run)
        self.config = config
        self.num_prompts = num_prompts
        self.dispatcher = dispatcher
        self.config_sha256 = config_sha256
        self.prompts_sha256 = prompts_sha256
        self.clock_ms = clock_ms
        self.metrics = metrics or ProxyMetrics()
        self.worker_alive_s = worker_alive_s
        self.record_ttl_s = record_ttl_s
        self._scripts: dict[str, Script] = {}
        self._permutations: dict[int, list[int]] = {}
        self._snapshot_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._changes = 0
        self._snapshot_changes = -1
        self._last_gc: tuple[int, frozenset[int]] | None = None
        # Highest version whose first lease this process has seen marked in Redis (saves a round trip).
        self._first_use_marked = -1
        # The end of the previous tick and what the proxy saw then: (ms, held back, trainer starved).
        self._last_tick: tuple[int, bool, bool] | None = None

    @classmethod
    def from_bucket(cls, redis: Redis, bucket: Bucket, run: str, dispatcher: Dispatcher, **kwargs: Any) -> Coordinator:
        """A coordinator for a run created by ``asyncgrpo run create`` (config and prompts verified)."""
        from proxy.run.store import load_run

        config, prompts, run_manifest = load_run(bucket, run)
        return cls(
            redis,
            bucket,
            run,
            config,
            len(prompts),
            dispatcher,
            config_sha256=run_manifest.config.sha256,
            prompts_sha256=run_manifest.prompts.sha256,
            **kwargs,
        )

    # ---- plumbing ----

    @property
    def _async(self) -> Any:
        return self.config.async_

    def script(self, name: str) -> Script:
        script = self._scripts.get(name)
        if script is None:
            script = self.redis.register_script(getattr(lua_scripts, name))
            self._scripts[name] = script
        return script

    def _call(self, name: str, keys: list[str], args: list[Any]) -> list[Any]:
        """Run a script; on NO_STATE rebuild the run's state once and run it again."""
        reply = self.script(name)(keys=keys, args=[self.keys.prefix, *args])
        if reply[0] == "NO_STATE":
            self.ensure_state()
            reply = self.script(name)(keys=keys, args=[self.keys.prefix, *args])
            if reply[0] == "NO_STATE":
                raise StateMissing(f"Redis holds no state for run {self.run!r} even after a rebuild")
        return reply

    def _changed(self) -> None:
        with self._state_lock:
            self._changes += 1

    @property
    def _track_rollouts(self) -> str:
        """The scripts' ``track`` argument: "0" when ``rollout_retention_versions = -1`` keeps every rollout."""
        return "0" if self._async.rollout_retention_versions < 0 else "1"

    def _count(self, field_name: str, amount: int = 1) -> None:
        self._call("ADD_COUNTER", [self.keys.state, self.keys.counters], [field_name, amount])

    def run_limits(self) -> RunLimits:
        """The limits of the run as ``/metrics`` exports them."""
        return RunLimits(
            max_staleness_versions=self._async.max_staleness,
            queue_maxsize_groups=self._async.queue_maxsize,
            groups_per_step=self._async.groups_per_step,
        )

    # ---- state lifecycle ----

    def ensure_state(self) -> str:
        """Make sure Redis holds the run's state: 'present', or else 'fresh'/'rebuilt' from the bucket."""
        if self.redis.exists(self.keys.state):
            return "present"
        from proxy.coordinator.snapshot import restore_state

        outcome = restore_state(self)
        self._changed()
        self._last_gc = None
        return outcome

    def current_version(self) -> int:
        value = self.redis.hget(self.keys.state, "current_version")
        return -1 if value is None else int(value)

    def _permutation(self, epoch: int) -> list[int]:
        perm = self._permutations.get(epoch)
        if perm is None:
            perm = list(range(self.num_prompts))
            random.Random(self.config.seed + epoch).shuffle(perm)
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            self._permutations[epoch] = perm
        return perm

    def _candidates(self, epoch: int, pos: int, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            perm = self._permutation(epoch)
            take = perm[pos : pos + count - len(out)]
            out.extend(take)
            pos += len(take)
            if pos >= self.num_prompts:
                epoch, pos = epoch + 1, 0
        return out

    # ---- leases ----

    def _grant(self, lease_id: str, version: int, sha: str | None, expires_ms: int) -> LeaseGrant:
        return LeaseGrant(
            lease_id=lease_id,
            version=version,
            adapter_prefix=bucket_keys.adapter_prefix(self.run, version),
            manifest_key=bucket_keys.manifest_key(self.run, version),
            manifest_sha256=sha or "",
            ttl_s=self._async.lease_ttl_s,
            expires_at=expires_ms / 1000.0,
        )

    def lease(self, worker_id: str, task_id: str) -> LeaseGrant:
        lease_id = uuid.uuid4().hex
        ttl_ms = int(self._async.lease_ttl_s * 1000)
        now = self.clock_ms()
        reply = self._call(
            "GRANT_LEASE",
            [self.keys.state, self.keys.counters, self.keys.leases, self.keys.versions],
            [now, ttl_ms, lease_id, worker_id, task_id],
        )
        if reply[0] == "NO_VERSION":
            raise NoVersionYet(f"run {self.run!r} has no published version yet; the init step is still running")
        version = int(reply[1])
        if version > self._first_use_marked:
            self._observe_first_use(version, now)
        return self._grant(lease_id, version, reply[2], int(reply[3]))

    def _observe_first_use(self, version: int, now_ms: int) -> None:
        """At the first lease on ``version``, observe the seconds since it was published.

        The publish time is the ``published_ms`` that PUBLISH_VERSION writes, with the CAS, into the record
        of the step that made the version (step == version); that record expires ``record_ttl_s`` after the
        publish. The first lease is told apart by HSETNX on the same record, so it is counted once even
        across proxy restarts. A record without ``published_ms`` (expired, or Redis rebuilt) is left alone.
        """
        step_key = self.keys.step(version)
        published_ms = self.redis.hget(step_key, "published_ms")
        if published_ms is None:
            self._first_use_marked = version
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(step_key, "first_lease_ms", now_ms)
        # Backstop: should the record have expired between the two calls, the stub HSETNX made expires too.
        pipe.expire(step_key, self.record_ttl_s, nx=True)
        first, _ = pipe.execute()
        self._first_use_marked = version
        if first:
            seconds = max(0, now_ms - int(published_ms)) / 1000.0
            self.metrics.version_first_use.observe(seconds)
            log.info("proxy.version_first_use", version=version, seconds=seconds)

    def renew(self, lease_id: str) -> LeaseGrant:
        ttl_ms = int(self._async.lease_ttl_s * 1000)
        reply = self._call(
            "RENEW_LEASE",
            [self.keys.state, self.keys.leases, self.keys.versions],
            [self.clock_ms(), ttl_ms, lease_id],
        )
        if reply[0] == "LEASE_LOST":
            raise LeaseLostError(
                f"lease {lease_id} expired or is unknown; renew more often than async.lease_ttl_s="
                f"{self._async.lease_ttl_s}"
            )
        return self._grant(lease_id, int(reply[1]), reply[2], int(reply[3]))

    def release(self, lease_id: str) -> bool:
        reply = self._call("RELEASE_LEASE", [self.keys.counters, self.keys.leases], [lease_id])
        return bool(int(reply[1]))

    def expire_leases(self) -> int:
        reply = self._call("EXPIRE_LEASES", [self.keys.counters, self.keys.leases], [self.clock_ms()])
        return int(reply[1])

    def live_leased_versions(self) -> set[int]:
        now = self.clock_ms()
        lease_ids = self.redis.zrangebyscore(self.keys.leases, f"({now}", "+inf")
        if not lease_ids:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for lease_id in lease_ids:
            pipe.hget(self.keys.lease(lease_id), "version")
        return {int(v) for v in pipe.execute() if v is not None}

    # ---- generate tasks ----

    def dispatch_one(self) -> GenerateTaskMessage | None:
        """Create one generate task if the buffer has room (the caller sends it); None when full."""
        cfg = self._async
        for _ in range(8):
            epoch_raw, pos_raw = self.redis.hmget(self.keys.state, ["epoch", "epoch_pos"])
            epoch, pos = int(epoch_raw or 0), int(pos_raw or 0)
            deadline = self.clock_ms() + int(cfg.generate_task_timeout_s * 1000)
            reply = self._call(
                "DISPATCH_GENERATE",
                [self.keys.state, self.keys.counters, self.keys.requeue, self.keys.tasks_inflight],
                [
                    self.clock_ms(),
                    deadline,
                    cfg.groups_per_task,
                    cfg.queue_maxsize,
                    epoch,
                    pos,
                    self.num_prompts,
                    self.run,
                    *self._candidates(epoch, pos, cfg.groups_per_task),
                ],
            )
            if reply[0] == "NO_ROOM":
                return None
            if reply[0] == "OK":
                self._changed()
                groups = [GroupRef(**g) for g in json.loads(reply[2])]
                return GenerateTaskMessage(run=self.run, task_id=reply[1], groups=groups)
        raise RuntimeError("dispatch_generate kept seeing the epoch position move; is a second proxy running?")

    def cancel_tasks(self, task_ids: list[str], *, force: bool) -> tuple[int, int]:
        """Cancel in-flight tasks (past their deadline, or any if ``force``); returns (tasks, groups)."""
        if not task_ids:
            return 0, 0
        reply = self._call(
            "CANCEL_TASKS",
            [
                self.keys.state,
                self.keys.counters,
                self.keys.requeue,
                self.keys.tasks_inflight,
                self.keys.rollout_retention,
            ],
            [self.clock_ms(), self.record_ttl_s, "1" if force else "0", self._track_rollouts, *task_ids],
        )
        tasks, groups = int(reply[1]), int(reply[2])
        if tasks:
            self._changed()
            log.warning("proxy.tasks_cancelled", tasks=tasks, groups_requeued=groups, forced=force)
        return tasks, groups

    def expire_tasks(self) -> tuple[int, int]:
        due = self.redis.zrangebyscore(self.keys.tasks_inflight, "-inf", self.clock_ms())
        return self.cancel_tasks(list(due), force=False)

    # ---- rollouts ----

    def submit(self, submission: RolloutSubmission) -> SubmitResult:
        """Admit a rollout iff it is fresh; raises StaleRolloutError, TaskCancelled, BadRollout."""
        expected_key = bucket_keys.rollout_key(self.run, submission.task_id)
        if submission.key != expected_key:
            raise BadRollout(f"rollout key {submission.key!r} must be {expected_key!r} for task {submission.task_id}")
        known_reasons = set(self.redis.hkeys(self.keys.rejected_reasons))
        rejected = []
        for item in submission.rejected_groups:
            reason = normalise_reason(item.reason)
            if reason not in known_reasons and len(known_reasons) >= MAX_REJECT_REASONS:
                reason = "other"
            rejected.append([item.group_id, reason])
        ref = {
            "task_id": submission.task_id,
            "key": submission.key,
            "sha256": submission.sha256,
            "version": submission.version,
            "group_ids": submission.group_ids,
        }
        reply = self._call(
            "SUBMIT_ROLLOUT",
            [
                self.keys.state,
                self.keys.counters,
                self.keys.rejected_reasons,
                self.keys.requeue,
                self.keys.tasks_inflight,
                self.keys.buffer,
                self.keys.rollout_retention,
            ],
            [
                self.clock_ms(),
                self._async.max_staleness,
                self.record_ttl_s,
                submission.task_id,
                submission.worker_id,
                submission.version,
                json.dumps(ref, separators=(",", ":")),
                json.dumps(submission.group_ids),
                json.dumps(rejected),
                OMITTED_GROUP_REASON,
                self._track_rollouts,
            ],
        )
        code = reply[0]
        if code == "STALE":
            self._changed()
            self.write_snapshot()
            raise StaleRolloutError(submission.version, int(reply[1]), self._async.max_staleness)
        if code == "CANCELLED":
            self._changed()  # its rollout went (back) under retention
            raise TaskCancelled(
                f"task {submission.task_id} was cancelled (not submitted within async.generate_task_timeout_s="
                f"{self._async.generate_task_timeout_s}, or lost in a proxy rebuild); its prompts were requeued"
            )
        if code == "UNKNOWN_TASK":
            raise UnknownTask(f"task {submission.task_id} was never dispatched by the proxy of run {self.run!r}")
        if code == "BAD_ROLLOUT":
            raise BadRollout(f"rollout of task {submission.task_id} refused: {reply[1]}")
        # A duplicate may have put a finished rollout back under retention.
        self._changed()
        # Admitted (or admitted before): durable in the bucket before the worker hears so.
        self.write_snapshot()
        return SubmitResult(status="admitted" if code == "OK" else "duplicate")

    # ---- steps ----

    def claim_step(self) -> OptimizeTaskMessage | None:
        """Claim the next step if enough fresh groups are buffered (or the init step); None otherwise."""
        return self._claim()[0]

    def _claim(self) -> tuple[OptimizeTaskMessage | None, int]:
        """(the claimed step or None, groups dropped as too stale on the way)."""
        cfg = self._async
        now = self.clock_ms()
        reply = self._call(
            "CLAIM_STEP",
            [self.keys.state, self.keys.counters, self.keys.requeue, self.keys.buffer, self.keys.rollout_retention],
            [now, cfg.groups_per_step * cfg.publish_every, cfg.max_staleness, self.record_ttl_s, self._track_rollouts],
        )
        if reply[0] == "NOT_READY":
            dropped = int(reply[2])
            if dropped:
                self._changed()
                log.info("proxy.stale_dropped_at_claim", groups=dropped)
            return None, dropped
        self._changed()
        step, base = int(reply[1]), int(reply[2])
        for item in filter(None, reply[4].split(",")):
            version, admitted_ms, groups = (int(part) for part in item.split(":"))
            for _ in range(groups):
                self.metrics.sample_staleness.observe(base - version)
                self.metrics.time_in_buffer.observe(max(0, now - admitted_ms) / 1000.0)
        rollouts = [RolloutRef(**ref) for ref in json.loads(reply[3])]
        log.info("proxy.step_claimed", step=step, base_version=base, rollouts=len(rollouts), dropped=int(reply[5]))
        message = OptimizeTaskMessage(run=self.run, step=step, base_version=base, rollouts=rollouts)
        return message, int(reply[5])

    def get_step(self, step: int) -> StepBatch:
        record = self.redis.hgetall(self.keys.step(step))
        if "rollouts" not in record:
            raise StepNotFound(f"step {step} of run {self.run!r} was not claimed (or its record expired)")
        return StepBatch(
            step=int(record["step"]),
            base_version=int(record["base_version"]),
            rollouts=[RolloutRef(**ref) for ref in json.loads(record["rollouts"])],
        )

    def _step_due(self) -> tuple[OptimizeTaskMessage, bool] | None:
        """The in-flight step if it was never sent or its send timed out: (message, is_resend)."""
        inflight = self.redis.hget(self.keys.state, "step_inflight")
        if inflight is None or int(inflight) < 0:
            return None
        record = self.redis.hgetall(self.keys.step(int(inflight)))
        if record.get("state") != "claimed":
            return None
        sent_ms = int(record.get("sent_ms", 0))
        timeout_ms = int(self._async.optimize_task_timeout_s * 1000)
        if sent_ms and self.clock_ms() - sent_ms <= timeout_ms:
            return None
        message = OptimizeTaskMessage(
            run=self.run,
            step=int(record["step"]),
            base_version=int(record["base_version"]),
            rollouts=[RolloutRef(**ref) for ref in json.loads(record["rollouts"])],
        )
        return message, int(record.get("sends", 0)) > 0

    def send_due_step(self) -> int | None:
        due = self._step_due()
        if due is None:
            return None
        message, resend = due
        try:
            self.dispatcher.send_optimize(message)
        except DispatchError as error:
            log.warning("proxy.optimize_send_failed", step=message.step, error=str(error))
            return None
        self._call(
            "MARK_STEP_SENT",
            [self.keys.state, self.keys.counters],
            [self.clock_ms(), message.step, "1" if resend else "0"],
        )
        if resend:
            log.warning("proxy.optimize_resent", step=message.step)
        return message.step

    def publish(self, request: PublishRequest) -> PublishResult:
        """CAS ``current == base_version -> version`` after checking the manifest in the bucket."""
        current = self.current_version()
        try:
            manifest, sha = read_manifest(self.bucket, self.run, request.version)
        except ObjectNotFound as error:
            self._count("conflicts")
            raise ManifestMissing(
                f"version {request.version} has no MANIFEST.json in the bucket; upload every file, then the "
                "manifest, then publish",
                current,
            ) from error
        except IntegrityError as error:
            self._count("conflicts")
            raise ManifestMismatch(str(error), current) from error
        if sha != request.manifest_sha256:
            self._count("conflicts")
            raise ManifestMismatch(
                f"manifest of version {request.version} in the bucket has sha256 {sha}, the request says "
                f"{request.manifest_sha256}; another trainer wrote this version",
                current,
            )
        meta = manifest.metadata
        for name in ("step", "base_version"):
            if name in meta and meta[name] != getattr(request, name):
                self._count("conflicts")
                raise ManifestMismatch(
                    f"manifest of version {request.version} names {name}={meta[name]}, the request "
                    f"{name}={getattr(request, name)}",
                    current,
                )
        reply = self._call(
            "PUBLISH_VERSION",
            [self.keys.state, self.keys.counters, self.keys.versions, self.keys.rollout_retention],
            [
                self.clock_ms(),
                request.version,
                request.base_version,
                request.step,
                request.manifest_sha256,
                request.worker_id,
                self.record_ttl_s,
                self._track_rollouts,
            ],
        )
        code, current = reply[0], int(reply[1])
        if code in PUBLISH_CONFLICTS:
            raise PUBLISH_CONFLICTS[code](
                f"publish of v{request.version} from base v{request.base_version} (step {request.step}) refused "
                f"({code}): the current version is v{current}",
                current,
            )
        if code == "OK":
            self._changed()
            log.info("proxy.version_published", version=request.version, worker=request.worker_id)
        try:
            self.write_snapshot()
        except SnapshotFailed as error:
            # The CAS is done; a rebuild adopts the version from its manifest, so this answer stays true.
            log.error("proxy.snapshot_after_publish_failed", error=str(error))
        return PublishResult(current_version=current)

    # ---- workers ----

    def heartbeat(self, report: HeartbeatRequest) -> None:
        self._call(
            "RECORD_HEARTBEAT",
            [self.keys.workers],
            [
                self.clock_ms(),
                report.worker_id,
                report.model_dump_json(),
                int(WORKER_FORGET_S * 1000),
                self.record_ttl_s,
            ],
        )

    def workers(self) -> list[WorkerRecord]:
        now = self.clock_ms()
        ids = self.redis.zrange(self.keys.workers, 0, -1)
        pipe = self.redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hmget(self.keys.worker(worker_id), ["report", "last_seen_ms"])
        out = []
        for report, last_seen in pipe.execute():
            if report is None:
                continue
            seen = int(last_seen)
            out.append(
                WorkerRecord(
                    **json.loads(report),
                    last_seen=seen / 1000.0,
                    alive=now - seen <= self.worker_alive_s * 1000,
                )
            )
        return out

    # ---- reading ----

    def run_info(self) -> RunInfo:
        return RunInfo(
            run=self.run,
            config_key=bucket_keys.config_key(self.run),
            config_sha256=self.config_sha256,
            prompts_key=bucket_keys.prompts_key(self.run),
            prompts_sha256=self.prompts_sha256,
            num_prompts=self.num_prompts,
            current_version=self.current_version(),
        )

    def status(self) -> StatusResponse:
        now = self.clock_ms()
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.keys.state)
        pipe.hgetall(self.keys.counters)
        pipe.hgetall(self.keys.rejected_reasons)
        pipe.llen(self.keys.requeue)
        pipe.zcard(self.keys.tasks_inflight)
        pipe.zrangebyscore(self.keys.leases, f"({now}", "+inf", withscores=True)
        state, counters, reasons, requeued, tasks, leases = pipe.execute()
        pipe = self.redis.pipeline(transaction=False)
        for lease_id, _ in leases:
            pipe.hgetall(self.keys.lease(lease_id))
        lease_records = [
            LeaseRecord(
                lease_id=lease_id,
                version=int(rec["version"]),
                worker_id=rec["worker_id"],
                task_id=rec["task_id"],
                expires_at=expires / 1000.0,
            )
            for (lease_id, expires), rec in zip(leases, pipe.execute(), strict=True)
            if rec
        ]
        alive: dict[str, int] = {}
        for worker in self.workers():
            if worker.alive:
                alive[worker.role] = alive.get(worker.role, 0) + 1
        step_inflight = int(state.get("step_inflight", -1))
        current = int(state.get("current_version", -1))
        return StatusResponse(
            run=self.run,
            current_version=current,
            final_version=self.config.final_version,
            finished=current >= self.config.final_version,
            step_inflight=step_inflight if step_inflight >= 0 else None,
            epoch=int(state.get("epoch", 0)),
            epoch_pos=int(state.get("epoch_pos", 0)),
            groups_buffered=int(state.get("groups_buffered", 0)),
            groups_inflight=int(state.get("groups_inflight", 0)),
            groups_requeued=requeued,
            tasks_inflight=tasks,
            counters={k: int(v) for k, v in counters.items()},
            rejected_by_reason={k: int(v) for k, v in reasons.items()},
            leases=lease_records,
            workers_alive_by_role=alive,
        )

    def group_record(self, group_id: str) -> dict[str, str]:
        return self.redis.hgetall(self.keys.group(group_id))

    # ---- snapshot and GC ----

    def write_snapshot(self, *, force: bool = False) -> bool:
        """Write ``runs/<run>/proxy/snapshot.json`` if anything changed since the last one; True if written."""
        from proxy.coordinator.snapshot import read_state_document

        with self._snapshot_lock:
            with self._state_lock:
                target = self._changes
            if not force and target == self._snapshot_changes:
                return False
            document = read_state_document(self)
            if document is None:
                return False
            try:
                self.bucket.put(
                    bucket_keys.proxy_snapshot_key(self.run),
                    json.dumps(document, separators=(",", ":"), sort_keys=True).encode(),
                )
            except (BucketError, OSError) as error:
                raise SnapshotFailed(f"could not write the proxy snapshot of run {self.run!r}: {error}") from error
            self._snapshot_changes = target
            return True

    def gc(self) -> list[int]:
        """Delete versions older than ``current - max_staleness - 1`` that no live lease holds.

        Every ``keep_every``-th version and the current one are kept. Versions newer than the window (an
        upload in progress) are never touched. Runs only when the current version or the leased set changed.
        """
        current = self.current_version()
        if current < 0:
            return []
        leased = frozenset(self.live_leased_versions())
        if self._last_gc == (current, leased):
            return []
        cutoff = current - self._async.max_staleness - 1
        keep_every = self._async.keep_every
        deleted = []
        for version in list_versions(self.bucket, self.run):
            if version >= cutoff or version in leased or (keep_every and version % keep_every == 0):
                continue
            delete_version(self.bucket, self.run, version)
            deleted.append(version)
        if deleted:
            self._count("versions_deleted", len(deleted))
            log.info("proxy.versions_collected", versions=deleted, current=current, leased=sorted(leased))
        self._last_gc = (current, leased)
        return deleted

    def collect_rollouts(self) -> list[str]:
        """Delete rollout objects whose retention is over; returns the task ids whose objects went.

        The scripts queue a rollout in ``rollout_retention`` once it can never be trained (again): trained in
        the step that produced version S (score S), or dropped as stale, rejected or cancelled (score: the
        current version then). Its object goes once ``current >= score + async.rollout_retention_versions``.
        Buffered and claimed rollouts are never queued, and DUE_ROLLOUTS checks that again, so invariant 4
        holds and a redelivered optimize task of an unpublished step finds its rollouts. A snapshot is written
        before anything is deleted, so a rebuild never resurrects a finished rollout as buffered or claimed.
        Deleting is idempotent; a failed delete stays queued for the next tick.
        """
        retention = self._async.rollout_retention_versions
        current = self.current_version()
        if retention < 0 or current < 0:
            return []
        max_version = current - retention
        reply = self._call(
            "DUE_ROLLOUTS",
            [self.keys.state, self.keys.rollout_retention],
            [max_version, MAX_ROLLOUT_DELETES_PER_TICK],
        )
        due, protected = list(reply[1]), list(reply[2])
        if protected:
            # A bug elsewhere queued a rollout that may still be trained: never delete it.
            log.error("proxy.rollout_retention_skipped_needed", task_ids=protected)
            self._changed()
        if not due:
            return []
        try:
            self.write_snapshot(force=True)
        except SnapshotFailed as error:
            log.warning("proxy.rollout_gc_postponed", error=str(error))
            return []
        deleted: list[str] = []
        for task_id in due:
            key = bucket_keys.rollout_key(self.run, task_id)
            try:
                self.bucket.delete(key)
            except (BucketError, OSError) as error:
                # The rest stay queued; the bucket is probably unreachable, so stop for this tick.
                log.warning("proxy.rollout_delete_failed", key=key, error=str(error))
                break
            deleted.append(task_id)
        if deleted:
            self._call(
                "FORGET_ROLLOUTS",
                [self.keys.state, self.keys.counters, self.keys.rollout_retention],
                [max_version, *deleted],
            )
            self._changed()
            log.info("proxy.rollouts_collected", count=len(deleted), current=current, retention=retention)
        return deleted

    # ---- bottleneck accounting ----

    def _account_waiting(self) -> None:
        """At the end of a tick: credit the time since the previous tick to what the proxy saw at its end.

        Between two ticks the state stays what the previous tick left (submits and publishes wake a tick at
        once), so its conditions are credited with the whole gap. The totals are Redis counters in
        milliseconds (``dispatch_backpressure_ms``, ``trainer_starved_ms``) so they survive a proxy restart;
        the first tick of a process credits nothing, as the gap before it is unknown.
        """
        now = self.clock_ms()
        if self._last_tick is not None:
            since_ms, held_back, starved = self._last_tick
            elapsed_ms = max(0, now - since_ms)
            if elapsed_ms and held_back:
                self._count("dispatch_backpressure_ms", elapsed_ms)
            if elapsed_ms and starved:
                self._count("trainer_starved_ms", elapsed_ms)
        self._last_tick = (now, *self._waiting_now())

    def _waiting_now(self) -> tuple[bool, bool]:
        """(dispatch held back by a full buffer, trainer starved of groups), as the state is now."""
        cfg = self._async
        fields = {"current_version": -1, "step_inflight": -1, "groups_inflight": 0, "groups_buffered": 0}
        raw = self.redis.hmget(self.keys.state, list(fields))
        current, step_inflight, inflight, buffered = (
            default if value is None else int(value) for value, default in zip(raw, fields.values(), strict=True)
        )
        if current >= self.config.final_version:
            return False, False
        held_back = inflight + buffered + cfg.groups_per_task > cfg.queue_maxsize
        starved = step_inflight < 0 and current >= 0 and buffered < cfg.groups_per_step * cfg.publish_every
        return held_back, starved

    # ---- the loop body ----

    def tick(self) -> TickReport:
        """One round of housekeeping; the server runs it every ``tick_s`` and after submits and publishes."""
        report = TickReport()
        outcome = self.ensure_state()
        if outcome != "present":
            report.rebuilt = outcome
        report.leases_expired = self.expire_leases()
        report.tasks_cancelled, _ = self.expire_tasks()
        # The run ends at its final version (optimizer.total_steps): nothing more is claimed or dispatched.
        finished = self.current_version() >= self.config.final_version
        if not finished:
            claimed, report.stale_dropped = self._claim()
            if claimed is not None:
                report.step_claimed = claimed.step
        new_tasks: list[GenerateTaskMessage] = []
        # Generate tasks wait for version 0: a worker could not lease anything before it exists.
        while not finished and self.current_version() >= 0 and len(new_tasks) < MAX_TASKS_PER_TICK:
            message = self.dispatch_one()
            if message is None:
                break
            new_tasks.append(message)
        try:
            self.write_snapshot()
        except SnapshotFailed as error:
            # Never hand out work the bucket does not know about: a rebuild would hand it out again.
            log.error("proxy.snapshot_failed", error=str(error))
            self.cancel_tasks([m.task_id for m in new_tasks], force=True)
            self._account_waiting()
            return report
        unsent = []
        for message in new_tasks:
            try:
                self.dispatcher.send_generate(message)
                report.tasks_sent.append(message.task_id)
            except DispatchError as error:
                log.warning("proxy.generate_send_failed", task_id=message.task_id, error=str(error))
                unsent.append(message.task_id)
        self.cancel_tasks(unsent, force=True)
        report.step_sent = self.send_due_step()
        try:
            report.versions_deleted = self.gc()
        except (BucketError, OSError) as error:
            log.warning("proxy.gc_failed", error=str(error))
        report.rollouts_deleted = self.collect_rollouts()
        self._account_waiting()
        if report.busy():
            log.debug("proxy.tick", **{k: v for k, v in report.__dict__.items() if v})
        return report
