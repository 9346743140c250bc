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

This module only wires the parts together around one ``RedisStore`` and runs ``tick()``; each concern lives in
its own module (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from redis import Redis

from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.protocol.evals import EvalLeaseGrant, EvalResultAnswer, EvalResultRequest
from asyncgrpo.protocol.schemas import (
    CorruptReport,
    CorruptResult,
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
from proxy.coordinator.errors import NotTaskHolder
from proxy.coordinator.evaluations import Evaluations
from proxy.coordinator.generate_tasks import GenerateTasks
from proxy.coordinator.housekeeping import Housekeeping
from proxy.coordinator.leadership import ProxyFence
from proxy.coordinator.leases import Leases, live_leased_versions
from proxy.coordinator.metrics import ProxyMetrics, RunLimits, StateGauges
from proxy.coordinator.pacing import InflightPacer, WaitingAccount
from proxy.coordinator.rebuild import restore_state
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

class Coordinator(Housekeeping):
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
        self.store = RedisStore(redis, run, rebuild=self.ensure_state, clock_ms=clock_ms, record_ttl_s=record_ttl_s)
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
        self.require_generate_worker = require_generate_worker
        self.bucket_outage = False
        """The last snapshot write failed: no new task is created until one succeeds."""

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
        if self.store.has_state():
            return "present"
        if self.fence is not None:
            self.fence.confirm()  # only the lease holder rebuilds (after a FLUSHALL: a new, higher epoch)
        outcome = restore_state(self.store, self.bucket, self.config)
        self.store.mark_changed()
        self.retention.forget_last_gc()
        return outcome

    def current_version(self) -> int:
        return self.store.current_version()

    # ---- requests (the HTTP API) ----

    def lease(self, worker_id: str, task_id: str, incarnation: str = "") -> LeaseGrant:
        """``incarnation``: of the worker process; a newer one of ``worker_id`` ends the task (``workers``)."""
        grant = self.leases.grant(worker_id, task_id, incarnation)
        self.pacer.leased(task_id)
        return grant

    def renew(self, lease_id: str) -> LeaseGrant:
        return self.leases.renew(lease_id)

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

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

    def get_step(self, step: int) -> StepBatch:
        return self.steps.get(step)

    def start_step(self, step: int, request: StepStartRequest) -> StepStartResult:
        """The worker starts the step and becomes its holder; raises StepNoLongerClaimed for an old copy."""
        return self.step_failures.start(step, request)

    def report_step_failure(self, step: int, report: StepFailureReport) -> StepFailureResult:
        """Reject a named rollout, count an attempt, or note an unloadable base (``step_failures``)."""
        return self.step_failures.report(step, report)

    def publish(self, request: PublishRequest) -> PublishResult:
        """CAS ``current == base_version -> version`` after checking the manifest in the bucket."""
        result = self.steps.publish(request)
        self.pacer.published(request.version)
        return result

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

    def eval_lease(self, worker_id: str, task_id: str, incarnation: str = "") -> EvalLeaseGrant:
        """Lease the version of an evaluate task (``evaluations``); raises EvalEnded if it is not in flight."""
        return self.evals.lease(worker_id, task_id, incarnation)

    def eval_result(self, task_id: str, request: EvalResultRequest) -> EvalResultAnswer:
        """Keep an evaluate task's summary and release its lease; raises EvalEnded if it is not in flight."""
        return self.evals.result(task_id, request)

    def heartbeat(self, report: HeartbeatRequest) -> bool:
        """Record a heartbeat; True if it came from a restarted worker (a new incarnation of its id), whose old
        incarnation's work the next ``tick()`` ends."""
        return self.heartbeats.heartbeat(report)

    def version_info(self, version: int) -> VersionInfo:
        """The manifest sha256 recorded when ``version`` was published; raises VersionNotFound."""
        return self.versions.info(version)

    def report_corrupt(self, version: int, report: CorruptReport) -> CorruptResult:
        """Read the reported object again; repair it from its holder's memory, or halt the run."""
        return self.versions.report_corrupt(version, report, self.dispatcher)

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
        answer = status(self.store, self.config, self.heartbeats)
        if self.evals.enabled:
            answer.evals_pending = self.evals.pending_count()
            answer.eval_latest = self.evals.latest()
        return answer

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
        """Send or re-send the in-flight step if due (``step_sending``): claimed, dead holder, timeout."""
        self.step_failures.review_halt()
        return self.sending.send_due(self.dispatcher)

    def write_snapshot(self, *, force: bool = False) -> bool:
        """Write ``runs/<run>/proxy/snapshot.json`` if anything changed since the last one; True if written."""
        return self.snapshots.write(force=force)

    def gc(self) -> list[int]:
        """Delete versions out of the staleness window that no live lease holds (``Retention``)."""
        return self.retention.collect_versions()

    def collect_rollouts(self) -> list[str]:
        """Delete rollout objects whose retention is over; returns their task ids (``Retention``)."""
        return self.retention.collect_rollouts()
