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
bucket (``proxy.coordinator.rebuild``).

This module only wires the parts together around one ``RunStore`` and runs ``tick()``; each concern lives in
its own module (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from redis import Redis

from proxy.coordinator.accounting import WaitingAccount
from proxy.coordinator.dispatch import Dispatcher, DispatchError
from proxy.coordinator.errors import SnapshotFailed
from proxy.coordinator.generate_tasks import GenerateTasks
from proxy.coordinator.leases import Leases, live_leased_versions
from proxy.coordinator.metrics import ProxyMetrics, RunLimits, StateGauges
from proxy.coordinator.pacing import InflightPacer
from proxy.coordinator.rebuild import restore_state
from proxy.coordinator.redis_keys import RunKeys
from proxy.coordinator.retention import Retention
from proxy.coordinator.rollouts import RolloutIntake
from proxy.coordinator.snapshot import SnapshotWriter
from proxy.coordinator.status import gauges, group_record, run_info, status
from proxy.coordinator.steps import Steps
from proxy.coordinator.store import RECORD_TTL_S, RunStore, wall_clock_ms
from proxy.coordinator.workers import Workers
from proxy.protocol.schemas import (
    GenerateTaskMessage,
    HeartbeatRequest,
    LeaseGrant,
    OptimizeTaskMessage,
    PublishRequest,
    PublishResult,
    RolloutSubmission,
    RunInfo,
    StatusResponse,
    StepBatch,
    SubmitResult,
    WorkerRecord,
)
from proxy.run.config import RunConfig
from proxy.run.store import load_run
from proxy.storage.bucket import Bucket, BucketError

log = structlog.get_logger()

MAX_TASKS_PER_TICK = 256


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
        self.store = RunStore(redis, run, rebuild=self.ensure_state, clock_ms=clock_ms, record_ttl_s=record_ttl_s)
        if num_prompts < 1:
            raise ValueError(f"the run has {num_prompts} prompts; it needs at least one")
        self.bucket = bucket
        self.run = run
        self.config = config
        self.num_prompts = num_prompts
        self.dispatcher = dispatcher  # tests may swap it: the parts get it per call, never keep it
        self.config_sha256 = config_sha256
        self.prompts_sha256 = prompts_sha256
        self.metrics = metrics or ProxyMetrics()
        self.snapshots = SnapshotWriter(self.store, bucket, self.metrics.snapshot_writes.inc)
        self.leases = Leases(self.store, config.async_, self.metrics)
        self.pacer = InflightPacer(config.async_, self.store.clock_ms)
        self.metrics.inflight_limit.set_function(self.pacer.limit)
        self.tasks = GenerateTasks(self.store, config, num_prompts, inflight_limit=self.pacer.limit)
        self.rollouts = RolloutIntake(self.store, config.async_, self.snapshots)
        self.steps = Steps(self.store, config.async_, bucket, self.snapshots, self.metrics)
        self.heartbeats = Workers(self.store, worker_alive_s)
        self.retention = Retention(self.store, config.async_, bucket, self.snapshots)
        self.accounting = WaitingAccount(self.store, config, inflight_limit=self.pacer.limit)

    @classmethod
    def from_bucket(cls, redis: Redis, bucket: Bucket, run: str, dispatcher: Dispatcher, **kwargs: Any) -> Coordinator:
        """A coordinator for a run created by ``asyncgrpo run create`` (config and prompts verified)."""
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

    # ---- the store's parts, for tests and tools ----

    @property
    def redis(self) -> Redis:
        return self.store.redis

    @property
    def keys(self) -> RunKeys:
        return self.store.keys

    @property
    def clock_ms(self) -> Callable[[], int]:
        return self.store.clock_ms

    @property
    def record_ttl_s(self) -> int:
        return self.store.record_ttl_s

    def run_limits(self) -> RunLimits:
        """The limits of the run as ``/metrics`` exports them."""
        cfg = self.config.async_
        return RunLimits(
            max_staleness_versions=cfg.max_staleness,
            queue_maxsize_groups=cfg.queue_maxsize,
            groups_per_step=cfg.groups_per_step,
        )

    # ---- state lifecycle ----

    def ensure_state(self) -> str:
        """Make sure Redis holds the run's state: 'present', or else 'fresh'/'rebuilt' from the bucket."""
        if self.store.has_state():
            return "present"
        outcome = restore_state(self.store, self.bucket, self.config)
        self.store.mark_changed()
        self.retention.forget_last_gc()
        return outcome

    def current_version(self) -> int:
        return self.store.current_version()

    # ---- requests (the HTTP API) ----

    def lease(self, worker_id: str, task_id: str) -> LeaseGrant:
        grant = self.leases.grant(worker_id, task_id)
        self.pacer.leased(task_id)
        return grant

    def renew(self, lease_id: str) -> LeaseGrant:
        return self.leases.renew(lease_id)

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    def submit(self, submission: RolloutSubmission) -> SubmitResult:
        """Admit a rollout iff it is fresh; raises StaleRolloutError, TaskCancelled, BadRollout."""
        try:
            result = self.rollouts.submit(submission)
        finally:
            if submission.lease_id is not None:
                # Admitted, stale or refused: the worker is done with the version either way.
                self.leases.release(submission.lease_id)
        self.pacer.submitted(submission.task_id, submission.worker_id)
        return result

    def get_step(self, step: int) -> StepBatch:
        return self.steps.get(step)

    def publish(self, request: PublishRequest) -> PublishResult:
        """CAS ``current == base_version -> version`` after checking the manifest in the bucket."""
        result = self.steps.publish(request)
        self.pacer.published(request.version)
        return result

    def heartbeat(self, report: HeartbeatRequest) -> None:
        self.heartbeats.heartbeat(report)

    def workers(self) -> list[WorkerRecord]:
        return self.heartbeats.list()

    def run_info(self) -> RunInfo:
        return run_info(
            self.store,
            num_prompts=self.num_prompts,
            config_sha256=self.config_sha256,
            prompts_sha256=self.prompts_sha256,
        )

    def status(self) -> StatusResponse:
        return status(self.store, self.config, self.heartbeats)

    def gauges(self) -> StateGauges:
        """What ``/metrics`` exports: counts only (O(1) in leases and workers), unlike ``status()``."""
        return gauges(self.store, self.config, self.heartbeats.alive_s)

    def group_record(self, group_id: str) -> dict[str, str]:
        return group_record(self.store, group_id)

    # ---- housekeeping steps (``tick`` runs them; tests call them one by one) ----

    def expire_leases(self) -> int:
        return self.leases.expire()

    def live_leased_versions(self) -> set[int]:
        return live_leased_versions(self.store)

    def dispatch_one(self) -> GenerateTaskMessage | None:
        """Create one generate task if the buffer has room (the caller sends it); None when full."""
        return self.tasks.dispatch_one()

    def cancel_tasks(self, task_ids: list[str], *, force: bool) -> tuple[int, int]:
        """Cancel in-flight tasks (past their deadline, or any if ``force``); returns (tasks, groups)."""
        return self.tasks.cancel(task_ids, force=force)

    def expire_tasks(self) -> tuple[int, int]:
        return self.tasks.expire()

    def claim_step(self) -> OptimizeTaskMessage | None:
        """Claim the next step if enough fresh groups are buffered (or the init step); None otherwise."""
        return self.steps.claim()[0]

    def send_due_step(self) -> int | None:
        return self.steps.send_due(self.dispatcher)

    def write_snapshot(self, *, force: bool = False) -> bool:
        """Write ``runs/<run>/proxy/snapshot.json`` if anything changed since the last one; True if written."""
        return self.snapshots.write(force=force)

    def gc(self) -> list[int]:
        """Delete versions out of the staleness window that no live lease holds (``Retention``)."""
        return self.retention.collect_versions()

    def collect_rollouts(self) -> list[str]:
        """Delete rollout objects whose retention is over; returns their task ids (``Retention``)."""
        return self.retention.collect_rollouts()

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
            claimed, report.stale_dropped = self.steps.claim()
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
            self.accounting.account()
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
        if report.step_sent is not None:
            self.pacer.step_sent(report.step_sent)
        try:
            report.versions_deleted = self.gc()
        except (BucketError, OSError) as error:
            log.warning("proxy.gc_failed", error=str(error))
        report.rollouts_deleted = self.collect_rollouts()
        self.accounting.account()
        if report.busy():
            log.debug("proxy.tick", **{k: v for k, v in report.__dict__.items() if v})
        return report
