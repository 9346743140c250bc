"""The proxy's Prometheus metrics, in a registry of their own (one per app, so tests can build many).

Totals and gauges are read from Redis at scrape time by a collector, so they survive a proxy restart and
always agree with ``/v1/status``; the run's limits (``RunLimits``) are exported as gauges so that alert rules
need no hard-coded numbers. The histograms (staleness and time in buffer of the samples a step consumed,
publish-to-first-lease latency of each version, HTTP latency) and the HTTP error counter are observed by
this process. Every label is bounded: routes are route templates, roles are ``generate``/``optimize``,
rejection reasons are normalised and capped by the coordinator, HTTP errors are the stable codes of
``HTTP_ERROR_CODES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import ConfigDict
from redis.exceptions import RedisError

from asyncgrpo.protocol.errors import ERROR_CODES
from asyncgrpo.protocol.schemas import EvalSummary, FleetView, RunCounts, StatusResponse

log = structlog.get_logger()

# Redis counter field -> (metric name without _total, help)
COUNTERS: dict[str, tuple[str, str]] = {
    "leases_granted": ("asyncgrpo_leases_granted", "Adapter-version leases granted."),
    "leases_expired": ("asyncgrpo_leases_expired", "Leases that lapsed without renewal or release."),
    "leases_released": ("asyncgrpo_leases_released", "Leases released by their worker."),
    "tasks_dispatched": ("asyncgrpo_generate_tasks_dispatched", "Generate tasks sent."),
    "groups_dispatched": ("asyncgrpo_groups_dispatched", "Prompt groups sent in generate tasks."),
    "groups_requeue_served": ("asyncgrpo_groups_requeue_served", "Groups dispatched from the requeue line."),
    "rollouts_admitted": ("asyncgrpo_rollouts_admitted", "Rollouts admitted into the buffer."),
    "groups_admitted": ("asyncgrpo_groups_admitted", "Prompt groups admitted into the buffer."),
    "rollouts_duplicate": ("asyncgrpo_rollouts_duplicate", "Repeated submissions of an admitted rollout."),
    "rollouts_stale": ("asyncgrpo_rollouts_stale", "Rollouts dropped as too stale (at submit or claim)."),
    "groups_stale": ("asyncgrpo_stale_drops", "Prompt groups dropped as too stale and requeued."),
    "tasks_cancelled": ("asyncgrpo_generate_tasks_cancelled", "Generate tasks presumed lost."),
    "tasks_worker_lost": (
        "asyncgrpo_generate_tasks_worker_lost",
        "Generate tasks cancelled because their worker was lost: heartbeats stopped, or it restarted.",
    ),
    "tasks_worker_restarted": (
        "asyncgrpo_generate_tasks_worker_restarted",
        "Generate tasks cancelled because their worker id came back in a new incarnation (restarted).",
    ),
    "worker_restarts": (
        "asyncgrpo_worker_restarts",
        "New incarnations heard under a known worker id: a unit restarted its worker under the same id.",
    ),
    "groups_cancelled": ("asyncgrpo_groups_cancelled", "Groups of lost tasks, requeued."),
    "steps_claimed": ("asyncgrpo_steps_claimed", "Optimizer steps claimed."),
    "groups_claimed": ("asyncgrpo_groups_claimed", "Prompt groups claimed for steps."),
    "optimize_resent": (
        "asyncgrpo_optimize_resent",
        "Optimize tasks re-sent (dead holder, dead target, failure report, timeout).",
    ),
    "step_failures": ("asyncgrpo_step_failures", "Optimize attempts that failed without naming a rollout."),
    "steps_unclaimed": ("asyncgrpo_steps_unclaimed", "Steps un-claimed after a rejected rollout or attempts."),
    "groups_trained": ("asyncgrpo_groups_trained", "Prompt groups in a published step."),
    "publish": ("asyncgrpo_publish", "Versions published."),
    "conflicts": ("asyncgrpo_publish_conflicts", "Publish requests refused (CAS lost, bad manifest, ...)."),
    "versions_deleted": ("asyncgrpo_versions_deleted", "Adapter versions garbage-collected."),
    "versions_not_adopted": (
        "asyncgrpo_rebuild_versions_not_adopted",
        "Versions in the bucket a rebuild did not adopt (another batch, or a gap); inspect them.",
    ),
    "rollouts_deleted": ("asyncgrpo_rollouts_deleted", "Rollout objects deleted by retention."),
    "eval_tasks_sent": ("asyncgrpo_eval_tasks_sent", "Eval tasks created ([eval]), one per prompt chunk."),
    "eval_tasks_resent": ("asyncgrpo_eval_tasks_resent", "Eval tasks sent again (timed out, worker lost)."),
    "eval_tasks_done": ("asyncgrpo_eval_tasks_done", "Eval task results recorded."),
    "eval_versions_done": ("asyncgrpo_eval_versions_done", "Versions whose eval record was written."),
    "eval_versions_failed": (
        "asyncgrpo_eval_versions_failed",
        "Versions whose evaluation was given up after async.max_group_attempts sends of a task.",
    ),
    "eval_versions_skipped": (
        "asyncgrpo_eval_versions_skipped",
        "Due versions not evaluated because they were no longer in the bucket (after a Redis rebuild).",
    ),
}

# Redis counter field holding milliseconds -> (metric name in seconds without _total, help)
MILLISECOND_COUNTERS: dict[str, tuple[str, str]] = {
    "dispatch_backpressure_ms": (
        "asyncgrpo_dispatch_backpressure_seconds",
        "Seconds the proxy held generate dispatch back because in-flight + buffered groups filled "
        "async.queue_maxsize (run not finished).",
    ),
    "trainer_starved_ms": (
        "asyncgrpo_trainer_starved_seconds",
        "Seconds with no step in flight for want of buffered groups (a version exists, run not finished).",
    ),
}

HTTP_ERROR_CODES = tuple(ERROR_CODES)
"""The stable ``error`` codes of the proxy's JSON error bodies; the only values of the ``error`` label."""
OTHER_HTTP_ERROR = "other"

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
BUFFER_SECONDS_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
FIRST_USE_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)


class StateGauges(RunCounts):
    """What ``/metrics`` reads from Redis at each scrape: counts only, so a scrape costs the same with 10 or
    10,000 leases and workers (``proxy.coordinator.views.gauges`` reads it in one transaction)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    leases_active: int

    @classmethod
    def from_status(cls, status: StatusResponse) -> StateGauges:
        """The gauges of a full ``/v1/status`` answer (tests and tools that have one)."""
        counts = {name: getattr(status, name) for name in RunCounts.model_fields}
        return cls(leases_active=len(status.leases), **counts)


@dataclass(frozen=True)
class RunLimits:
    """The run's configured limits, exported as gauges (the final version comes with the status)."""

    max_staleness_versions: int
    queue_maxsize_groups: int
    groups_per_step: int

    def gauges(self) -> dict[str, tuple[str, int]]:
        return {
            "asyncgrpo_max_staleness_versions": (
                "async.max_staleness: the most versions a sample may lag the step that trains it.",
                self.max_staleness_versions,
            ),
            "asyncgrpo_queue_maxsize_groups": (
                "async.queue_maxsize: in-flight + buffered groups the proxy allows.",
                self.queue_maxsize_groups,
            ),
            "asyncgrpo_groups_per_step": (
                "async.groups_per_step: prompt groups in one optimizer step.",
                self.groups_per_step,
            ),
        }


class _StateCollector(Collector):
    """Reads the coordinator's gauges (or a full status) at scrape time."""

    def __init__(self, read_status: Callable[[], StateGauges | StatusResponse], limits: RunLimits | None) -> None:
        self.read_status = read_status
        self.limits = limits

    def collect(self) -> Iterator[Metric]:
        # The limits come from the (frozen) run config, so they are exported even when Redis is down.
        for name, (help_text, value) in (self.limits.gauges() if self.limits else {}).items():
            gauge = GaugeMetricFamily(name, help_text)
            gauge.add_metric([], value)
            yield gauge
        up = GaugeMetricFamily("asyncgrpo_redis_up", "1 if the proxy could read its state from Redis.")
        try:
            read = self.read_status()
        except RedisError as error:
            log.warning("proxy.metrics_unavailable", error=str(error))
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        status = read if isinstance(read, StateGauges) else StateGauges.from_status(read)
        gauges = {
            "asyncgrpo_current_version": ("Current published policy version (-1: none).", status.current_version),
            "asyncgrpo_step_inflight": (
                "Step claimed and not yet published (-1: none).",
                -1 if status.step_inflight is None else status.step_inflight,
            ),
            "asyncgrpo_leases_active": ("Live adapter-version leases.", status.leases_active),
            "asyncgrpo_groups_buffered": ("Admitted groups waiting for a step.", status.groups_buffered),
            "asyncgrpo_groups_inflight": ("Groups in generate tasks not yet submitted.", status.groups_inflight),
            "asyncgrpo_groups_requeued": ("Prompts back in line, served first.", status.groups_requeued),
            "asyncgrpo_generate_tasks_inflight": ("Generate tasks not yet submitted.", status.tasks_inflight),
            "asyncgrpo_epoch": ("Current pass over the prompts.", status.epoch),
            "asyncgrpo_final_version": ("The version at which the run ends.", status.final_version),
            "asyncgrpo_run_halted": (
                "1 while the run's steps are halted for an operator (see /v1/status halted).",
                int(status.halted is not None),
            ),
        }
        for name, (help_text, value) in gauges.items():
            gauge = GaugeMetricFamily(name, help_text)
            gauge.add_metric([], value)
            yield gauge
        for field, (name, help_text) in COUNTERS.items():
            counter = CounterMetricFamily(name, help_text)
            counter.add_metric([], status.counters.get(field, 0))
            yield counter
        for field, (name, help_text) in MILLISECOND_COUNTERS.items():
            counter = CounterMetricFamily(name, help_text)
            counter.add_metric([], status.counters.get(field, 0) / 1000.0)
            yield counter
        rejected = CounterMetricFamily(
            "asyncgrpo_groups_rejected", "Prompt groups rejected as bad input, by reason.", labels=["reason"]
        )
        for reason, count in sorted(status.rejected_by_reason.items()):
            rejected.add_metric([reason], count)
        yield rejected
        workers = GaugeMetricFamily("asyncgrpo_workers_alive", "Workers heard from recently.", labels=["role"])
        for role in ("generate", "optimize"):
            workers.add_metric([role], status.workers_alive_by_role.get(role, 0))
        yield workers


class _EvalCollector(Collector):
    """The newest evaluation (``[eval]``) and the versions awaiting one, read from Redis at scrape time."""

    def __init__(self, read: Callable[[], tuple[int, EvalSummary | None]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        try:
            pending, latest = self.read()
        except RedisError as error:
            log.warning("proxy.metrics_unavailable", error=str(error))
            return
        gauge = GaugeMetricFamily("asyncgrpo_evals_pending", "Versions due for evaluation whose record is not written.")
        gauge.add_metric([], pending)
        yield gauge
        version = GaugeMetricFamily("asyncgrpo_eval_version", "The newest evaluated version (-1: none yet).")
        version.add_metric([], -1 if latest is None else latest.version)
        yield version
        metrics = latest.metrics if latest is not None else {}
        reward = GaugeMetricFamily(
            "asyncgrpo_eval_reward",
            "Mean eval reward of the newest evaluated version: total and per reward.",
            labels=["reward"],
        )
        if "reward" in metrics:
            reward.add_metric(["total"], metrics["reward"])
        for key, value in sorted(metrics.items()):
            if key.startswith("rewards/") and key.endswith("/mean"):
                reward.add_metric([key[len("rewards/") : -len("/mean")]], value)
        yield reward
        pass_at_k = GaugeMetricFamily(
            "asyncgrpo_eval_pass_at_k", "pass@k of the newest evaluated version (eval.pass_threshold).", labels=["k"]
        )
        for key, value in sorted(metrics.items()):
            if key.startswith("pass@"):
                pass_at_k.add_metric([key[len("pass@") :]], value)
        yield pass_at_k


class _FleetCollector(Collector):
    """The autoscaling signal: no series until the pacer has measured the trainer and the generate tasks (a
    fresh or restarted proxy), so an autoscaler reading it holds its fleet instead of acting on a guess."""

    def __init__(self, read: Callable[[], FleetView | None]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        try:
            fleet = self.read()
        except RedisError as error:
            log.warning("proxy.metrics_unavailable", error=str(error))
            return
        if fleet is None:
            return
        for name, help_text, value in (
            (
                "asyncgrpo_generate_workers_wanted",
                "Generate workers that keep the trainer busy: ceil(tasks per version * (task seconds + delivery) / "
                "step seconds), capped by the tasks queue_maxsize admits; 0 once the run reached its final version.",
                fleet.wanted,
            ),
            (
                "asyncgrpo_generate_workers_submitting",
                "Generate workers that submitted a rollout within the pacing window: the fleet the wanted count "
                "compares with.",
                fleet.submitting,
            ),
            (
                "asyncgrpo_pacing_step_seconds",
                "Median trainer time per version, optimize task sent to publish.",
                fleet.step_s,
            ),
            (
                "asyncgrpo_pacing_generate_task_seconds",
                "Median generate task service time, lease to submission.",
                fleet.task_s,
            ),
            (
                "asyncgrpo_pacing_tasks_per_version",
                "Generate tasks one version's batch takes.",
                fleet.tasks_per_version,
            ),
        ):
            gauge = GaugeMetricFamily(name, help_text)
            gauge.add_metric([], value)
            yield gauge


class ProxyMetrics:
    """Registry plus the histograms the proxy observes itself."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.sample_staleness = Histogram(
            "asyncgrpo_sample_staleness_versions",
            "Staleness (current - sample version) of each group consumed by a step, observed at claim.",
            buckets=STALENESS_BUCKETS,
            registry=self.registry,
        )
        self.time_in_buffer = Histogram(
            "asyncgrpo_time_in_buffer_seconds",
            "Seconds from admission to claim of each group consumed by a step.",
            buckets=BUFFER_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.http_seconds = Histogram(
            "asyncgrpo_http_request_seconds",
            "HTTP request latency by route template and method.",
            labelnames=["route", "method"],
            registry=self.registry,
        )
        self.version_first_use = Histogram(
            "asyncgrpo_version_first_use_seconds",
            "Seconds from the publish of each version to the first lease granted on it.",
            buckets=FIRST_USE_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.http_errors = Counter(
            "asyncgrpo_http_errors",
            "HTTP requests answered with an error body, by its stable error code.",
            labelnames=["error"],
            registry=self.registry,
        )
        self.snapshot_writes = Counter(
            "asyncgrpo_snapshot_writes",
            "Snapshot puts to the bucket by this process; one put makes every change counted before it durable "
            "(group commit), so under load it stays well below the submit rate.",
            registry=self.registry,
        )
        self.snapshot_compactions = Counter(
            "asyncgrpo_snapshot_compactions",
            "Snapshot puts that were compactions (the whole state; every other put is a log segment of what "
            "changed since the last put).",
            registry=self.registry,
        )
        self.snapshot_put_bytes = Counter(
            "asyncgrpo_snapshot_put_bytes",
            "Bytes of snapshot compactions and log segments put to the bucket by this process.",
            registry=self.registry,
        )
        self.inflight_limit = Gauge(
            "asyncgrpo_inflight_limit_groups",
            "In-flight + buffered groups the proxy allows now: paced from the measured trainer step and generate "
            "task times (async.adaptive_inflight), never above async.queue_maxsize.",
            registry=self.registry,
        )
        self.groups_unattended = Gauge(
            "asyncgrpo_groups_unattended",
            "Groups of in-flight generate tasks that no worker renews a lease of (a worker vanished without being "
            "found dead or restarted); the paced limit does not count them (queue_maxsize does), and they end at their "
            "deadline.",
            registry=self.registry,
        )
        for code in HTTP_ERROR_CODES:
            # Every code starts at 0, so rate() and increase() see the first error too.
            self.http_errors.labels(code)
        self._collector: _StateCollector | None = None
        self._eval_collector: _EvalCollector | None = None
        self._fleet_collector: _FleetCollector | None = None

    def snapshot_written(self, compaction: bool, size: int) -> None:
        """One snapshot put landed: a compaction or a log segment of ``size`` bytes."""
        self.snapshot_put_bytes.inc(size)
        if compaction:
            self.snapshot_compactions.inc()

    def count_http_error(self, code: str) -> None:
        """Count one error answer; a code outside ``HTTP_ERROR_CODES`` is counted as 'other'."""
        if code not in HTTP_ERROR_CODES:
            log.warning("proxy.unknown_http_error_code", error=code)
            code = OTHER_HTTP_ERROR
        self.http_errors.labels(code).inc()

    def watch_state(
        self, read_status: Callable[[], StateGauges | StatusResponse], limits: RunLimits | None = None
    ) -> None:
        """Expose the coordinator's totals and gauges (read at every scrape) and the run's limits."""
        if self._collector is not None:
            self.registry.unregister(self._collector)
        self._collector = _StateCollector(read_status, limits)
        self.registry.register(self._collector)

    def watch_evals(self, read: Callable[[], tuple[int, EvalSummary | None]]) -> None:
        """Expose the evals (``[eval]``): versions pending, and the newest one's rewards and pass@k."""
        if self._eval_collector is not None:
            self.registry.unregister(self._eval_collector)
        self._eval_collector = _EvalCollector(read)
        self.registry.register(self._eval_collector)

    def watch_fleet(self, read: Callable[[], FleetView | None]) -> None:
        """Expose the autoscaling signal (``asyncgrpo_generate_workers_wanted``) and its inputs."""
        if self._fleet_collector is not None:
            self.registry.unregister(self._fleet_collector)
        self._fleet_collector = _FleetCollector(read)
        self.registry.register(self._fleet_collector)
