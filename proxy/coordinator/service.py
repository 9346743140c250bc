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
bucket (``proxy.coordinator.rebuild``). Invariants 8 and 9 on the generate side: ``tick()`` cancels the tasks
of lease holders whose heartbeats stopped, dispatches only while a generate worker is alive, and during a
bucket outage takes back the round's unsent tasks and creates none until a snapshot write succeeds.

This module only wires the parts together around one ``RedisStore``, hands them to ``Housekeeping`` (the round
``tick()`` runs) and is the one place that answers a missing state: a script that finds none raises
``StateMissing``, and every entry point here rebuilds the state from the bucket (``rebuild.StateRestorer``)
and calls again, once. Each concern lives in its own module (see the package docstring); tests reach the
parts as attributes (``coord.leases``, ``coord.tasks``, ``coord.snapshots``...).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import structlog
from redis import Redis

from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.protocol.evals import EvalLeaseGrant, EvalResultAnswer, EvalResultRequest
from asyncgrpo.protocol.schemas import (
    CorruptReport,
    CorruptResult,
    HeartbeatRequest,
    LeaseGrant,
    PublishRequest,
    PublishResult,
    RolloutSubmission,
    RunInfo,
    StatusResponse,
    StepBatch,
    StepFailureReport,
    StepFailureResult,
    StepStartRequest,
    StepStartResult,
    SubmitResult,
    TaskFailureReport,
    TaskFailureResult,
    VersionInfo,
    WorkerRecord,
)
from asyncgrpo.run.config import RunConfig
from asyncgrpo.run.creation import load_run
from proxy.coordinator.dispatch import Dispatcher
from proxy.coordinator.errors import NotTaskHolder, StateMissing
from proxy.coordinator.evaluations import Evaluations
from proxy.coordinator.generate_tasks import GenerateTasks
from proxy.coordinator.housekeeping import Housekeeping, TickReport
from proxy.coordinator.leadership import ProxyFence
from proxy.coordinator.leases import Leases
from proxy.coordinator.metrics import ProxyMetrics, RunLimits, StateGauges
from proxy.coordinator.pacing import InflightPacer, WaitingAccount
from proxy.coordinator.rebuild import StateRestorer
from proxy.coordinator.redis_keys import RunKeys
from proxy.coordinator.redis_store import RECORD_TTL_S, RedisStore
from proxy.coordinator.retention import Retention
from proxy.coordinator.rollouts import RolloutIntake
from proxy.coordinator.snapshot import SnapshotWriter
from proxy.coordinator.status import Workers, gauges, group_record, run_info, status
from proxy.coordinator.step_failures import StepFailures
from proxy.coordinator.step_sending import StepSending
from proxy.coordinator.steps import Steps
from proxy.coordinator.versions import Versions

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
        fence: ProxyFence | None = None,
        require_generate_worker: bool = True,
        num_eval_prompts: int = 0,
    ) -> None:
        """``fence``: the run's proxy lease (``proxy.coordinator.leadership``), None unfenced (tests).
        ``require_generate_worker``: dispatch generate tasks only while a generate worker is alive by its
        heartbeats (tests that never send heartbeats turn it off). ``num_eval_prompts``: the run's held-out
        prompts (``[eval]``; 0: no evaluation)."""
        self.fence = fence
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
        self.snapshots = SnapshotWriter(self.store, bucket, self.metrics.snapshot_writes.inc, fence)
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
        self.evals = Evaluations(self.store, config, bucket, num_eval_prompts)
        self.retention = Retention(
            self.store, config.async_, bucket, self.snapshots, protected=self.evals.protected_versions
        )
        self.accounting = WaitingAccount(self.store, config, inflight_limit=self.pacer.limit)
        self.restorer = StateRestorer(self.store, bucket, config, fence, self.retention)
        self.housekeeping = Housekeeping(
            store=self.store,
            config=config,
            restorer=self.restorer,
            leases=self.leases,
            tasks=self.tasks,
            steps=self.steps,
            sending=self.sending,
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
    def lease(self, worker_id: str, task_id: str, incarnation: str = "") -> LeaseGrant:
        """``incarnation``: of the worker process; a newer one of ``worker_id`` ends the task (``workers``)."""
        grant = self.leases.grant(worker_id, task_id, incarnation)
        self.pacer.leased(task_id)
        return grant

    @_rebuilding
    def renew(self, lease_id: str) -> LeaseGrant:
        return self.leases.renew(lease_id)

    @_rebuilding
    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    @_rebuilding
    def submit(self, submission: RolloutSubmission) -> SubmitResult:
        """Admit a rollout iff it is fresh; raises StaleRolloutError, TaskCancelled, BadRollout, NotTaskHolder."""
        release = submission.lease_id
        try:
            result = self.rollouts.submit(submission)
        except NotTaskHolder:
            release = None  # the lease may be another worker's: a refused submission changes nothing
            raise
        finally:
            if release is not None:
                # Admitted, stale or refused: the worker is done with the version either way.
                self.leases.release(release)
        self.pacer.submitted(submission.task_id, submission.worker_id)
        return result

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
        evaluate task is sent again at the next tick instead of at its deadline."""
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
        """Lease the version of an evaluate task (``evaluations``); raises EvalEnded if it is not in flight."""
        return self.evals.lease(worker_id, task_id, incarnation)

    @_rebuilding
    def eval_result(self, task_id: str, request: EvalResultRequest) -> EvalResultAnswer:
        """Keep an evaluate task's summary and release its lease; raises EvalEnded if it is not in flight."""
        return self.evals.result(task_id, request)

    @_rebuilding
    def heartbeat(self, report: HeartbeatRequest) -> bool:
        """Record a heartbeat; True if it came from a restarted worker (a new incarnation of its id), whose old
        incarnation's work the next ``tick()`` ends."""
        return self.heartbeats.heartbeat(report)

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
        return answer

    @_rebuilding
    def gauges(self) -> StateGauges:
        """What ``/metrics`` exports: counts only (O(1) in leases and workers), unlike ``status()``."""
        return gauges(self.store, self.config, self.heartbeats.alive_s)

    @_rebuilding
    def group_record(self, group_id: str) -> dict[str, str]:
        return group_record(self.store, group_id)
