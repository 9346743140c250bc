"""The coordinator: a run's live state in Redis, changed only by the Lua scripts of ``proxy.coordinator.scripts``.

One ``Coordinator`` serves one run. The HTTP layer (``proxy.api.app``) awaits the fleet's requests on its
event loop (``fleet_requests``: heartbeats, leases, renewals, releases, submits; ``proxy.coordinator.fleet``) and
calls the others (``get_step``, ``start_step``, ``publish``, the evals', the views) from its threads, as
FastAPI runs a synchronous route: they read and write the bucket. A background loop calls ``tick()`` which
expires leases and lost tasks, claims a step, keeps the generate queue fed, re-sends timed-out steps, writes
the snapshot and garbage-collects old versions and rollout objects past their retention. Tests call ``tick()``
directly and pass their own clock (milliseconds), so no test sleeps.

The rules it enforces are the invariants 1-4 and 6 of README.md: versions move by CAS ``N -> N+1`` only;
nothing staler than ``async.max_staleness`` is admitted or claimed; versions under a live lease or in the
staleness window are kept; every dispatched group ends exactly once (trained, stale, rejected or
cancelled) and the prompt of a stale or cancelled one goes back in line; an empty Redis is rebuilt from the
bucket (``proxy.coordinator.snapshot``). Invariants 8 and 9 on the generate side: ``tick()`` cancels the tasks
of lease holders whose heartbeats stopped, dispatches only while a generate worker is alive, and during a
bucket outage takes back the round's unsent tasks and creates none until a snapshot write succeeds.

Three classes, top down, each handed what it uses (nothing calls back up):

- ``Coordinator`` builds the parts around one ``RedisStore`` and is the one place that answers a missing
  state: a script that finds none raises ``StateMissing``, and every entry point rebuilds the state from the
  bucket (``StateRestorer``) and calls again, once. Tests reach the parts as attributes (``coord.leases``,
  ``coord.tasks``, ``coord.snapshots``...).
- ``Housekeeping`` is the round ``tick()`` runs: it rebuilds an empty Redis, expires leases and lost tasks,
  takes back the tasks of dead generate workers, repairs a missing step record and re-checks a halt, claims a
  step, keeps the generate queue fed (only while a generate worker is alive and the bucket takes snapshots),
  writes the snapshot before sending anything, sends or re-sends the step in flight, sends due evals,
  and collects old versions and rollouts.
- ``StateRestorer`` makes sure Redis holds the run's state (``rebuild.restore_state``), fenced by the proxy's
  leadership.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import structlog
from redis import Redis

from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.protocol.evals import EvalLeaseGrant, EvalResultAnswer, EvalResultRequest
from asyncgrpo.protocol.schemas import (
    CorruptReport,
    CorruptResult,
    FleetView,
    GenerateTaskMessage,
    PublishRequest,
    PublishResult,
    RunInfo,
    StatusResponse,
    StepBatch,
    StepFailureReport,
    StepFailureResult,
    StepStartRequest,
    StepStartResult,
    TaskFailureReport,
    TaskFailureResult,
    VersionInfo,
    WorkerRecord,
)
from asyncgrpo.run.config import RunConfig
from asyncgrpo.run.creation import load_run
from proxy.coordinator.dispatch import Dispatcher
from proxy.coordinator.evals import Evals
from proxy.coordinator.fleet import FleetRequests
from proxy.coordinator.generate_tasks import GenerateTasks, InflightPacer, WaitingAccount
from proxy.coordinator.leases import Leases, Retention
from proxy.coordinator.metrics import ProxyMetrics, RunLimits, StateGauges
from proxy.coordinator.rebuild import restore_state
from proxy.coordinator.redis_store import RECORD_TTL_S, RedisStore, RunKeys, halted_reason
from proxy.coordinator.rollouts import RolloutIntake
from proxy.coordinator.scripts import (
    SnapshotFailed,
    StateMissing,
)
from proxy.coordinator.snapshot import Leadership, SnapshotWriter
from proxy.coordinator.steps import StepFailures, Steps, StepSending, Versions
from proxy.coordinator.views import gauges, group_record, run_info, status
from proxy.coordinator.workers import Workers

MAX_TASKS_PER_TICK = 256


class StateRestorer:
    """Makes sure Redis holds the run's state: the first thing of every round, and of a request that found none
    (a script answered NO_STATE). Only the holder of the proxy's leadership rebuilds."""

    def __init__(
        self, store: RedisStore, bucket: Bucket, config: RunConfig, leadership: Leadership | None, retention: Retention
    ) -> None:
        self.store = store
        self.bucket = bucket
        self.config = config
        self.leadership = leadership
        self.retention = retention

    def ensure(self) -> str:
        """'present', or else 'fresh'/'rebuilt' from the bucket."""
        if self.store.has_state():
            return "present"
        if self.leadership is not None:
            self.leadership.confirm()  # only the leader rebuilds (after a FLUSHALL: a new, higher epoch)
        outcome = restore_state(self.store, self.bucket, self.config)
        self.store.mark_changed()
        self.retention.forget_last_gc()
        return outcome


@dataclass
class TickReport:
    """What one ``tick()`` did; returned for tests and logged when anything happened."""

    leases_expired: int = 0
    tasks_cancelled: int = 0
    tasks_worker_lost: int = 0
    tasks_undone: int = 0
    stale_dropped: int = 0
    step_claimed: int | None = None
    step_sent: int | None = None
    tasks_sent: list[str] = field(default_factory=list)
    versions_deleted: list[int] = field(default_factory=list)
    rollouts_deleted: list[str] = field(default_factory=list)
    rebuilt: str | None = None
    evals_sent: list[str] = field(default_factory=list)

    def busy(self) -> bool:
        return any(
            (
                self.leases_expired,
                self.tasks_cancelled,
                self.tasks_worker_lost,
                self.tasks_undone,
                self.stale_dropped,
                self.step_claimed is not None,
                self.step_sent is not None,
                self.tasks_sent,
                self.versions_deleted,
                self.rollouts_deleted,
                self.rebuilt,
                self.evals_sent,
            )
        )


class Housekeeping:
    """``tick()``: one round over the parts of one run's coordinator, in order, each doing its own part of it
    (``tick``, ``dispatch``, ``send_due``); the parts are handed in by ``Coordinator`` (``service``)."""

    def __init__(
        self,
        *,
        store: RedisStore,
        config: RunConfig,
        restorer: StateRestorer,
        leases: Leases,
        tasks: GenerateTasks,
        steps: Steps,
        step_failures: StepFailures,
        versions: Versions,
        evals: Evals,
        heartbeats: Workers,
        pacer: InflightPacer,
        accounting: WaitingAccount,
        snapshots: SnapshotWriter,
        retention: Retention,
        metrics: ProxyMetrics,
        require_generate_worker: bool,
    ) -> None:
        self.store = store
        self.config = config
        self.restorer = restorer
        self.leases = leases
        self.tasks = tasks
        self.steps = steps
        self.step_failures = step_failures
        self.versions = versions
        self.evals = evals
        self.heartbeats = heartbeats
        self.pacer = pacer
        self.accounting = accounting
        self.snapshots = snapshots
        self.retention = retention
        self.metrics = metrics
        self.require_generate_worker = require_generate_worker
        self.bucket_outage = False
        """The last snapshot write failed: no new task is created until one succeeds."""

    def tick(self, dispatcher: Dispatcher) -> TickReport:
        """One round of housekeeping; the server runs it every ``tick_s`` and after submits and publishes.
        ``dispatcher`` is passed per round: tests swap the coordinator's."""
        report = TickReport()
        outcome = self.restorer.ensure()
        if outcome != "present":
            report.rebuilt = outcome
        report.leases_expired = self.leases.expire()
        report.tasks_cancelled, report.tasks_worker_lost = self.tasks.tick(self.heartbeats.alive_s)
        self.versions.tick()
        # The run ends at its final version (optimizer.total_steps): nothing more is claimed or dispatched.
        finished = self.store.current_version() >= self.config.final_version
        # A halted run claims no step (proxy.coordinator.steps); generation goes on until the buffer is full.
        if not finished and halted_reason(self.store) is None:
            claimed, report.stale_dropped = self.steps.claim()
            if claimed is not None:
                report.step_claimed = claimed.step
        new_tasks: list[GenerateTaskMessage] = []
        # Generate tasks wait for version 0 (nothing can be leased before), for the bucket to take snapshots
        # again after an outage, and for a generate worker to be alive (no queue grows that nobody consumes).
        if not finished and self.store.current_version() >= 0 and not self.bucket_outage and self._generate_consumed():
            new_tasks, unattended = self.tasks.dispatch(MAX_TASKS_PER_TICK)
            self.metrics.groups_unattended.set(unattended)
        if not self._write_tick_snapshot(new_tasks, report):
            self.accounting.account()
            return report
        report.tasks_sent = self.tasks.send(new_tasks, dispatcher)
        report.step_sent = self.step_failures.send_due(dispatcher)
        if report.step_sent is not None:
            self.pacer.step_sent(report.step_sent)
        # Before GC, so a version that just became due is protected; sent only while a generate worker is alive
        # (they run the eval tasks), or every attempt would time out unconsumed.
        report.evals_sent = self.evals.tick(dispatcher, self.heartbeats.alive_s, send=self._generate_consumed())
        report.versions_deleted, report.rollouts_deleted = self.retention.tick()
        self.accounting.account()
        if report.busy():
            log.debug("proxy.tick", **{k: v for k, v in report.__dict__.items() if v})
        return report

    # ---- invariant 8: no dispatch nobody consumes, no churn in a bucket outage ----

    def _generate_consumed(self) -> bool:
        """True if generate tasks may be sent: a generate worker is alive, or the check is off."""
        return not self.require_generate_worker or self.heartbeats.alive_count("generate") > 0

    def _write_tick_snapshot(self, new_tasks: list[GenerateTaskMessage], report: TickReport) -> bool:
        """Write the round's snapshot; False (and the round's new tasks taken back) if the bucket refused it.

        During an outage every round tries again (``force``: nothing may have changed) but creates no task;
        the outage is logged once when it starts and once when it ends.
        """
        try:
            self.snapshots.write(force=self.bucket_outage)
        except SnapshotFailed as error:
            # Never hand out work the bucket does not know about: a rebuild would hand it out again. Those
            # tasks were never sent, so they are taken back, not cancelled.
            report.tasks_undone = self.tasks.undo([m.task_id for m in new_tasks])
            if not self.bucket_outage:
                log.warning("proxy.snapshot_failed", error=str(error), hint="no new generate task until it succeeds")
            self.bucket_outage = True
            return False
        if self.bucket_outage:
            log.info("proxy.snapshot_recovered")
            self.bucket_outage = False
        return True


log = structlog.get_logger()

T = TypeVar("T")
P = ParamSpec("P")


def _rebuilding(method: Callable[Concatenate[Coordinator, P], T]) -> Callable[Concatenate[Coordinator, P], T]:
    """An entry point that rebuilds a missing state and calls again, once (``Coordinator._with_state``)."""

    @functools.wraps(method)
    def entry(self: Coordinator, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._with_state(lambda: method(self, *args, **kwargs))

    return entry


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
        clock_ms: Callable[[], int] | None = None,
        metrics: ProxyMetrics | None = None,
        worker_alive_s: float = 15.0,
        record_ttl_s: int = RECORD_TTL_S,
        leadership: Leadership | None = None,
        require_generate_worker: bool = True,
        num_eval_prompts: int = 0,
    ) -> None:
        """``leadership``: the run's leadership (``proxy.coordinator.snapshot``), None unfenced (tests).
        ``require_generate_worker``: dispatch generate tasks only while a generate worker is alive by its
        heartbeats (tests that never send heartbeats turn it off). ``num_eval_prompts``: the run's held-out
        prompts (``[eval]``; 0: no evaluation)."""
        self.leadership = leadership
        self.store = RedisStore(redis, run, clock_ms=clock_ms, record_ttl_s=record_ttl_s)
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
        self.snapshots = SnapshotWriter(
            self.store, bucket, self.metrics.snapshot_writes.inc, leadership, on_written=self.metrics.snapshot_written
        )
        self.leases = Leases(self.store, config.async_, self.metrics)
        self.pacer = InflightPacer(config.async_, self.store.clock_ms)
        self.metrics.inflight_limit.set_function(self.pacer.limit)
        self.tasks = GenerateTasks(self.store, config, num_prompts, inflight_limit=self.pacer.limit)
        self.rollouts = RolloutIntake(self.store, config.async_, self.snapshots)
        self.heartbeats = Workers(self.store, worker_alive_s)
        self.sending = StepSending(self.store, config.async_, worker_alive_s)
        self.versions = Versions(self.store, bucket, self.sending)
        self.steps = Steps(
            self.store, config.async_, bucket, self.snapshots, self.metrics, self.versions, config.final_version
        )
        self.step_failures = StepFailures(self.store, config.async_, self.sending, self.versions)
        self.evals = Evals(self.store, config, bucket, num_eval_prompts)
        self.retention = Retention(
            self.store, config.async_, bucket, self.snapshots, protected=self.evals.protected_versions
        )
        self.accounting = WaitingAccount(self.store, config, inflight_limit=self.pacer.limit)
        self.restorer = StateRestorer(self.store, bucket, config, leadership, self.retention)
        self.fleet_requests = FleetRequests(
            self.store,
            self.leases,
            self.rollouts,
            self.heartbeats,
            self.pacer,
            ensure_state=lambda: self.restorer.ensure(),
        )
        self.housekeeping = Housekeeping(
            store=self.store,
            config=config,
            restorer=self.restorer,
            leases=self.leases,
            tasks=self.tasks,
            steps=self.steps,
            step_failures=self.step_failures,
            versions=self.versions,
            evals=self.evals,
            heartbeats=self.heartbeats,
            pacer=self.pacer,
            accounting=self.accounting,
            snapshots=self.snapshots,
            retention=self.retention,
            metrics=self.metrics,
            require_generate_worker=require_generate_worker,
        )

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
            num_eval_prompts=run_manifest.num_eval_prompts,
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
        return self.restorer.ensure()

    def _with_state(self, call: Callable[[], T]) -> T:
        """``call()``; if a script found no state (Redis flushed or restarted empty), rebuild it and call again."""
        try:
            return call()
        except StateMissing:
            self.restorer.ensure()
        try:
            return call()
        except StateMissing as error:
            raise StateMissing(f"Redis holds no state for run {self.run!r} even after a rebuild") from error

    def tick(self) -> TickReport:
        """One round of housekeeping (``housekeeping``); the server runs it every ``tick_s`` and after submits
        and publishes."""
        return self._with_state(lambda: self.housekeeping.tick(self.dispatcher))

    def current_version(self) -> int:
        return self.store.current_version()

    # ---- requests (the HTTP API) ----

    @_rebuilding
    def get_step(self, step: int) -> StepBatch:
        return self.steps.get(step)

    @_rebuilding
    def start_step(self, step: int, request: StepStartRequest) -> StepStartResult:
        """The worker starts the step and becomes its holder; raises StepNoLongerClaimed for an old copy."""
        return self.step_failures.start(step, request)

    @_rebuilding
    def report_step_failure(self, step: int, report: StepFailureReport) -> StepFailureResult:
        """Reject a named rollout, count an attempt, or note an unloadable base (``step_failures``)."""
        return self.step_failures.report(step, report)

    @_rebuilding
    def publish(self, request: PublishRequest) -> PublishResult:
        """CAS ``current == base_version -> version`` after checking the manifest in the bucket."""
        result = self.steps.publish(request)
        self.pacer.published(request.version)
        return result

    @_rebuilding
    def report_task_failure(self, task_id: str, report: TaskFailureReport) -> TaskFailureResult:
        """A worker's generate task failed for good: cancel it now and count the attempt (invariant 9). An
        eval task is sent again at the next tick instead of at its deadline."""
        if self.evals.fail(task_id, report.worker_id):
            log.warning(
                "proxy.eval_failure_reported", task_id=task_id, worker_id=report.worker_id, reason=report.reason
            )
            return TaskFailureResult(cancelled=True)
        cancelled = self.tasks.fail(task_id, report.worker_id, report.reason, prompt_at_fault=report.prompt_at_fault)
        log.warning(
            "proxy.task_failure_reported",
            task_id=task_id,
            worker_id=report.worker_id,
            reason=report.reason,
            detail=report.detail[:500],
            cancelled=cancelled,
        )
        return TaskFailureResult(cancelled=cancelled)

    @_rebuilding
    def eval_lease(self, worker_id: str, task_id: str, incarnation: str = "") -> EvalLeaseGrant:
        """Lease the version of an eval task (``evals``); raises EvalEnded if it is not in flight."""
        return self.evals.lease(worker_id, task_id, incarnation)

    @_rebuilding
    def eval_result(self, task_id: str, request: EvalResultRequest) -> EvalResultAnswer:
        """Keep an eval task's summary and release its lease; raises EvalEnded if it is not in flight."""
        return self.evals.result(task_id, request)

    @_rebuilding
    def version_info(self, version: int) -> VersionInfo:
        """The manifest sha256 recorded when ``version`` was published; raises VersionNotFound."""
        return self.versions.info(version)

    @_rebuilding
    def report_corrupt(self, version: int, report: CorruptReport) -> CorruptResult:
        """Read the reported object again; repair it from its holder's memory, or halt the run."""
        return self.versions.report_corrupt(version, report, self.dispatcher)

    @_rebuilding
    def workers(self) -> list[WorkerRecord]:
        return self.heartbeats.list()

    @_rebuilding
    def run_info(self) -> RunInfo:
        return run_info(
            self.store,
            num_prompts=self.num_prompts,
            config_sha256=self.config_sha256,
            prompts_sha256=self.prompts_sha256,
        )

    @_rebuilding
    def status(self) -> StatusResponse:
        answer = status(self.store, self.config, self.heartbeats)
        if self.evals.enabled:
            answer.evals_pending = self.evals.pending_count()
            answer.eval_latest = self.evals.latest()
        answer.fleet = self.fleet()
        return answer

    def fleet(self) -> FleetView | None:
        """The autoscaling signal: the pacer's fleet size, and none wanted once the run is finished."""
        fleet = self.pacer.fleet()
        if fleet is not None and self.store.current_version() >= self.config.final_version:
            return fleet.model_copy(update={"wanted": 0})
        return fleet

    @_rebuilding
    def gauges(self) -> StateGauges:
        """What ``/metrics`` exports: counts only (O(1) in leases and workers), unlike ``status()``."""
        return gauges(self.store, self.config, self.heartbeats.alive_s)

    @_rebuilding
    def group_record(self, group_id: str) -> dict[str, str]:
        return group_record(self.store, group_id)
