"""The coordinator's loop body: ``tick()``, one round of housekeeping, and what it reports.

A round rebuilds an empty Redis, expires leases and lost tasks, takes back the tasks of dead generate workers,
repairs a missing step record and re-checks a halt, claims a step, keeps the generate queue fed (only while a
generate worker is alive and the bucket takes snapshots), writes the snapshot before sending anything, sends or
re-sends the step in flight, sends due evaluations (``evaluations``), and collects old versions and rollouts.
``Coordinator`` (``service``) builds the parts and hands them in; nothing here calls back up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from asyncgrpo.bucket.backends import BucketError
from asyncgrpo.protocol.schemas import GenerateTaskMessage
from asyncgrpo.run.config import RunConfig
from proxy.coordinator.dispatch import Dispatcher, DispatchError
from proxy.coordinator.errors import SnapshotFailed
from proxy.coordinator.evaluations import Evaluations
from proxy.coordinator.generate_tasks import GenerateTasks
from proxy.coordinator.leases import Leases
from proxy.coordinator.metrics import ProxyMetrics
from proxy.coordinator.pacing import InflightPacer, WaitingAccount
from proxy.coordinator.rebuild import StateRestorer
from proxy.coordinator.redis_store import RedisStore, halted_reason
from proxy.coordinator.retention import Retention
from proxy.coordinator.snapshot import SnapshotWriter
from proxy.coordinator.status import Workers
from proxy.coordinator.step_failures import StepFailures
from proxy.coordinator.step_sending import StepSending
from proxy.coordinator.steps import Steps
from proxy.coordinator.versions import Versions

log = structlog.get_logger()

MAX_TASKS_PER_TICK = 256


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
    """``tick()`` over the parts of one run's coordinator, handed in by ``Coordinator`` (``service``)."""

    def __init__(
        self,
        *,
        store: RedisStore,
        config: RunConfig,
        restorer: StateRestorer,
        leases: Leases,
        tasks: GenerateTasks,
        steps: Steps,
        sending: StepSending,
        step_failures: StepFailures,
        versions: Versions,
        evals: Evaluations,
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
        self.sending = sending
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
        report.tasks_cancelled, _ = self.tasks.expire()
        # Invariant 8: a task whose worker stopped sending heartbeats goes back in line now, not at its deadline.
        report.tasks_worker_lost = self.tasks.reap_dead(self.heartbeats.alive_s)
        self.versions.repair_missing_record()
        self.versions.recheck_halt()  # a corrupted object restored by an operator lifts its halt
        # The run ends at its final version (optimizer.total_steps): nothing more is claimed or dispatched.
        finished = self.store.current_version() >= self.config.final_version
        # A halted run claims no step (proxy.coordinator.step_failures); generation goes on until the buffer is full.
        if not finished and halted_reason(self.store) is None:
            claimed, report.stale_dropped = self.steps.claim()
            if claimed is not None:
                report.step_claimed = claimed.step
        new_tasks: list[GenerateTaskMessage] = []
        # Generate tasks wait for version 0 (nothing can be leased before), for the bucket to take snapshots
        # again after an outage, and for a generate worker to be alive (no queue grows that nobody consumes).
        if not finished and self.store.current_version() >= 0 and not self.bucket_outage and self._generate_consumed():
            # Ghosts (leased tasks nobody renews) are left out of the paced limit, not out of queue_maxsize.
            unattended = self.tasks.unattended_groups()
            self.metrics.groups_unattended.set(unattended)
            while len(new_tasks) < MAX_TASKS_PER_TICK:
                message = self.tasks.dispatch_one(unattended)
                if message is None:
                    break
                new_tasks.append(message)
        if not self._write_tick_snapshot(new_tasks, report):
            self.accounting.account()
            return report
        unsent = []
        for message in new_tasks:
            try:
                dispatcher.send_generate(message)
                report.tasks_sent.append(message.task_id)
            except DispatchError as error:
                log.warning("proxy.generate_send_failed", task_id=message.task_id, error=str(error))
                unsent.append(message.task_id)
        self.tasks.cancel(unsent, force=True)
        # Send or re-send the step in flight if due (``step_sending``): claimed, dead holder, timeout.
        self.step_failures.review_halt()
        report.step_sent = self.sending.send_due(dispatcher)
        if report.step_sent is not None:
            self.pacer.step_sent(report.step_sent)
        try:
            # Before GC, so a version that just became due is protected; sent only while a generate worker
            # is alive (they run the evaluate tasks), or every attempt would time out unconsumed.
            report.evals_sent = self.evals.tick(
                dispatcher, self.heartbeats.alive_s, send=self._generate_consumed()
            )
        except (BucketError, OSError) as error:
            log.warning("proxy.eval_tick_failed", error=str(error))
        try:
            report.versions_deleted = self.retention.collect_versions()
        except (BucketError, OSError) as error:
            log.warning("proxy.gc_failed", error=str(error))
        report.rollouts_deleted = self.retention.collect_rollouts()
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
