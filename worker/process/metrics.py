"""Prometheus metrics of a worker process (generate or optimize), served on its own port.

Every metric lives in ``REGISTRY`` (this module's own registry, with the process, platform and GC collectors),
so that the endpoint shows exactly the worker's metrics and a test can list what a worker exports. Names
start with ``asyncgrpo_``, carry their unit, and every label has a small fixed set of values (a status, an
error kind, a reward function name from the run config): never a task id, step or version.

This module defines the families, the endpoint and the process-level observations (errors, idle time, tasks
in flight), and moves the rest from each finished task's result: ``GenerateResult`` on the generate side,
the optimize step's ``StepRecord`` on the optimize side (``observe_generate_task``, ``observe_optimize_step``).
A figure that is None (a step with no tokens has no ratio) or not finite leaves its gauge as it was.

Reading the bottleneck pair: ``asyncgrpo_trainer_rollout_wait_seconds`` grows when the trainer sits idle for
want of samples (generation is the bottleneck); ``asyncgrpo_generate_backpressure_seconds`` grows when
generate workers sit idle because the buffer is full (the trainer is the bottleneck).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    start_http_server,
)
from prometheus_client.core import Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from asyncgrpo.protocol.records import StepRecord

if TYPE_CHECKING:  # the generate job pulls in torch; only its result type is needed here
    from worker.generate.job import GenerateResult

log = structlog.get_logger()

REGISTRY = CollectorRegistry(auto_describe=True)
# The same process/platform/GC figures the default registry has, on the worker's own registry.
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

ROLES = ("generate", "optimize")
ERROR_KINDS = ("integrity", "stale", "conflict", "proxy", "other")
GENERATE_STATUSES = ("admitted", "duplicate", "stale", "cancelled", "rejected", "not_holder")
EVAL_STATUSES = ("recorded", "ended", "failed")
OPTIMIZE_STATUSES = (
    "published",
    "already_published",
    "republished",
    "conflict",
    "not_claimed",
    "failed_rollout",
    "failed_step",
    "failed_base",
)
CLIP_BOUNDS = ("low", "high", "region")

# Seconds: from a fast adapter fetch (tens of ms) to a long generate or optimize task (half an hour).
_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 300.0, 900.0, 1800.0)
# Staleness in versions: max_staleness is at most 64 (RunConfig.async.max_staleness).
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def _histogram(name: str, documentation: str, buckets: tuple[float, ...] = _SECONDS_BUCKETS) -> Histogram:
    return Histogram(name, documentation, buckets=buckets, registry=REGISTRY)


def _gauge(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(name, documentation, labels, registry=REGISTRY)


def _counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(name, documentation, labels, registry=REGISTRY)


# ---- worker-wide ---------------------------------------------------------------------------------------
WORKER_INFO = Info(
    "asyncgrpo_worker", "This worker process: role, worker id, device, generation backend.", registry=REGISTRY
)
WORKER_ERRORS = _counter(
    "asyncgrpo_worker_errors", "Errors in tasks, by kind (integrity, stale, conflict, proxy, other).", ("kind",)
)
WORKER_TASKS_IN_FLIGHT = _gauge("asyncgrpo_worker_tasks_in_flight", "Tasks this worker is running now.", ("role",))

# ---- generate side ------------------------------------------------------------------------------------
GENERATE_TASKS = _counter("asyncgrpo_generate_tasks", "Generate tasks finished, by the proxy's answer.", ("status",))
GENERATE_TASK_SECONDS = _histogram("asyncgrpo_generate_task_seconds", "Wall time of one generate task.")
GENERATE_ADAPTER_FETCH_SECONDS = _histogram(
    "asyncgrpo_generate_adapter_fetch_seconds", "Time to get the leased adapter (cache or bucket) and load it."
)
GENERATE_SAMPLING_SECONDS = _histogram("asyncgrpo_generate_sampling_seconds", "Time spent sampling completions.")
GENERATE_SCORING_SECONDS = _histogram("asyncgrpo_generate_scoring_seconds", "Time spent computing rewards.")
GENERATE_BACKPRESSURE_SECONDS = _histogram(
    "asyncgrpo_generate_backpressure_seconds",
    "Time a generate worker sat idle between tasks (the proxy held back work because the buffer was full).",
)
GENERATE_TOKENS = _counter("asyncgrpo_generate_tokens", "Completion tokens generated.")
GENERATE_TASKS_LEFT_WINDOW = _counter(
    "asyncgrpo_generate_tasks_left_window",
    "Generate tasks stopped mid-sampling and handed back because a published version left their oldest token "
    'out of the window (async.stale_tokens = "drop"): sampled again under it, not finished and refused.',
)
GENERATE_TOKENS_RESUMED = _counter(
    "asyncgrpo_generate_tokens_resumed",
    "Completion tokens continued from partial sequences an interrupted task saved (async.partial_rollouts), "
    "not sampled again; not counted in asyncgrpo_generate_tokens_total.",
)
GENERATE_PARTIALS_DISCARDED = _counter(
    "asyncgrpo_generate_partials_discarded",
    "Saved partial groups a task could not continue (too stale, or another prompt or shape), sampled afresh.",
)
GENERATE_SAMPLES = _counter("asyncgrpo_generate_samples", "Completions generated.")
GENERATE_GROUPS = _counter("asyncgrpo_generate_groups", "Prompt groups generated.")
GENERATE_TOKENS_PER_SECOND = _gauge(
    "asyncgrpo_generate_tokens_per_second", "Completion tokens per second of sampling, in the last task."
)
GENERATE_SAMPLES_PER_SECOND = _gauge(
    "asyncgrpo_generate_samples_per_second", "Completions per second of task wall time, in the last task."
)
GENERATE_VERSION = _gauge("asyncgrpo_generate_version", "Adapter version the last generate task sampled with.")
GENERATE_REWARD_MEAN = _gauge("asyncgrpo_generate_reward_mean", "Mean total reward of the last generate task.")
EVAL_TASKS = _counter(
    "asyncgrpo_eval_tasks",
    "Eval tasks finished, by outcome: recorded (the proxy kept the result), ended (it no longer wanted it), "
    "failed (reported to the proxy, which sends it again).",
    ("status",),
)
for _status in EVAL_STATUSES:  # exported at 0 from the start: a failure shows as a rise, not a new series
    EVAL_TASKS.labels(status=_status)

# ---- optimize side: trainer ---------------------------------------------------------------------------
TRAINER_STEPS = _counter("asyncgrpo_trainer_steps", "Optimize tasks finished, by outcome.", ("status",))
TRAINER_STEP_SECONDS = _histogram("asyncgrpo_trainer_step_seconds", "Wall time of one optimize step.")
TRAINER_FORWARD_BACKWARD_SECONDS = _histogram(
    "asyncgrpo_trainer_forward_backward_seconds", "Forward and backward passes of one optimize step."
)
TRAINER_OPTIMIZER_SECONDS = _histogram(
    "asyncgrpo_trainer_optimizer_seconds", "Gradient clipping and optimizer update of one optimize step."
)
TRAINER_FETCH_SECONDS = _histogram(
    "asyncgrpo_trainer_rollout_fetch_seconds", "Time to fetch and verify a step's rollouts from the bucket."
)
TRAINER_RESCORE_SECONDS = _histogram(
    "asyncgrpo_trainer_rescore_seconds", "Time to rescore a step's rollouts under the version they claim."
)
TRAINER_PUBLISH_SECONDS = _histogram(
    "asyncgrpo_trainer_publish_seconds", "Time to upload a new version (files, then manifest)."
)
TRAINER_ROLLOUT_WAIT_SECONDS = _histogram(
    "asyncgrpo_trainer_rollout_wait_seconds",
    "Time the optimize worker sat idle between steps for want of admitted rollouts (trainer starved).",
)
TRAINER_TOKENS = _counter("asyncgrpo_trainer_tokens", "Completion tokens trained on.")
TRAINER_SAMPLES = _counter("asyncgrpo_trainer_samples", "Completions trained on.")
TRAINER_GROUPS = _counter("asyncgrpo_trainer_groups", "Prompt groups trained on.")
TRAINER_TOKENS_PER_SECOND = _gauge(
    "asyncgrpo_trainer_tokens_per_second", "Completion tokens per second of step wall time, in the last step."
)
TRAINER_SAMPLES_PER_STEP = _gauge("asyncgrpo_trainer_samples_per_step", "Completions in the last step.")
TRAINER_GROUPS_PER_STEP = _gauge("asyncgrpo_trainer_groups_per_step", "Prompt groups in the last step.")
TRAINER_VERSION = _gauge("asyncgrpo_trainer_version", "Version the trainer last produced.")
TRAINER_LAST_PUBLISH_TIMESTAMP = _gauge(
    "asyncgrpo_trainer_last_publish_timestamp_seconds", "Unix time the trainer last produced a version."
)

# ---- optimize side: lag -------------------------------------------------------------------------------
SAMPLE_STALENESS_VERSIONS = _histogram(
    "asyncgrpo_trainer_sample_staleness_versions",
    "Staleness of each completion trained on: step base version minus the version that generated it.",
    buckets=_STALENESS_BUCKETS,
)
STEP_MAX_STALENESS_VERSIONS = _gauge(
    "asyncgrpo_trainer_step_max_staleness_versions", "Largest staleness among the last step's rollouts."
)
STEP_TOKEN_STALENESS_MEAN_VERSIONS = _gauge(
    "asyncgrpo_trainer_step_token_staleness_mean_versions",
    "Mean over the last step's model tokens of base version minus the version that sampled each one (below the "
    "rollouts' staleness where sequences followed newer versions: async.inflight_versions = follow).",
)
STEP_TOKEN_STALENESS_MAX_VERSIONS = _gauge(
    "asyncgrpo_trainer_step_token_staleness_max_versions", "The stalest model token of the last step."
)
MASKED_STALE_TOKENS = _counter(
    "asyncgrpo_trainer_masked_stale_tokens_total",
    "Model tokens masked out of the loss because their version fell out of the staleness window "
    "(async.stale_tokens = mask).",
)

# ---- optimize side: policy ----------------------------------------------------------------------------
POLICY_RATIO = _gauge("asyncgrpo_policy_ratio", "Mean importance ratio pi/pi_behaviour over the last step's tokens.")
POLICY_RESCORE_RATIO = _gauge(
    "asyncgrpo_policy_rescore_ratio", "Mean ratio when rescoring rollouts under the version they claim (should be 1)."
)
POLICY_KL = _gauge("asyncgrpo_policy_kl", "k3 KL estimate of the policy to the behaviour policy, last step.")
POLICY_ENTROPY_NATS = _gauge("asyncgrpo_policy_entropy_nats", "Mean token entropy of the policy, last step.")
POLICY_CLIP_FRACTION = _gauge(
    "asyncgrpo_policy_clip_fraction",
    "Share of tokens whose ratio was clipped, last step (low, high, region).",
    ("bound",),
)
POLICY_IMPORTANCE_SAMPLING_RATIO = _gauge(
    "asyncgrpo_policy_importance_sampling_ratio",
    "Generator-trainer correction weight exp(trainer - generator logprob), last step (min, mean, max); only "
    "while the correction applies (loss.vllm_importance_sampling_correction).",
    ("stat",),
)
POLICY_SAMPLING_LOGP_DIFFERENCE = _gauge(
    "asyncgrpo_policy_sampling_logp_difference",
    "|trainer - generator| logprob per token of corrected samples, last step (mean, max).",
    ("stat",),
)
POLICY_TOOL_CALLS = _gauge(
    "asyncgrpo_policy_tool_calls_per_completion", "[agent] runs: mean tool calls per completion, last step."
)
POLICY_TOOL_FAILURE_RATIO = _gauge(
    "asyncgrpo_policy_tool_failure_ratio", "[agent] runs: share of the last step's tool calls that failed."
)
POLICY_TURNS = _gauge(
    "asyncgrpo_policy_turns_per_completion", "[agent] runs: mean model turns per completion, last step."
)
POLICY_LOSS = _gauge("asyncgrpo_policy_loss", "GRPO loss of the last step.")
POLICY_GRAD_NORM = _gauge("asyncgrpo_policy_grad_norm", "Global gradient norm before clipping, last step.")
POLICY_LEARNING_RATE = _gauge("asyncgrpo_policy_learning_rate", "Learning rate of the last step.")
POLICY_REWARD_MEAN = _gauge("asyncgrpo_policy_reward_mean", "Mean total reward of the last step's completions.")
POLICY_REWARD_STD = _gauge("asyncgrpo_policy_reward_std", "Std of the total reward of the last step's completions.")
POLICY_REWARD_FUNCTION_MEAN = _gauge(
    "asyncgrpo_policy_reward_function_mean", "Mean reward per reward function, last step.", ("reward",)
)
POLICY_REWARD_FUNCTION_STD = _gauge(
    "asyncgrpo_policy_reward_function_std", "Std of the reward per reward function, last step.", ("reward",)
)
POLICY_COMPLETION_LENGTH_TOKENS = _gauge(
    "asyncgrpo_policy_completion_length_tokens", "Mean completion length of the last step."
)
POLICY_TRUNCATED_RATIO = _gauge(
    "asyncgrpo_policy_truncated_ratio", "Share of the last step's completions cut at max_completion_length."
)
POLICY_FLAGGED_ROLLOUTS = _counter(
    "asyncgrpo_policy_flagged_rollouts", "Rollouts whose rescoring ratio drifted from 1 beyond the tolerance."
)

# Every labelled series starts at zero, so rate() and absent() work before the first event.
for _kind in ERROR_KINDS:
    WORKER_ERRORS.labels(kind=_kind)
for _role in ROLES:
    WORKER_TASKS_IN_FLIGHT.labels(role=_role)
for _status in GENERATE_STATUSES:
    GENERATE_TASKS.labels(status=_status)
for _status in OPTIMIZE_STATUSES:
    TRAINER_STEPS.labels(status=_status)
for _bound in CLIP_BOUNDS:
    POLICY_CLIP_FRACTION.labels(bound=_bound)

# A generate worker's endpoint leaves out the trainer's and policy families, an optimize worker's the
# generation families: a dashboard averaging asyncgrpo_policy_ratio must not see zeros from generators.
_FAMILIES_OF_OTHER_ROLE: dict[str, tuple[str, ...]] = {
    "generate": ("asyncgrpo_trainer_", "asyncgrpo_policy_"),
    "optimize": ("asyncgrpo_generate_", "asyncgrpo_eval_"),
}


class _RoleView(Collector):
    """``REGISTRY`` as one role's endpoint shows it."""

    def __init__(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"worker role {role!r} is unknown; use one of {', '.join(ROLES)}")
        self.hidden = _FAMILIES_OF_OTHER_ROLE[role]

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            if not family.name.startswith(self.hidden):
                yield family


def role_registry(role: str) -> CollectorRegistry:
    """The registry one role's endpoint serves: every family of ``REGISTRY`` that applies to the role."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RoleView(role))
    return registry


class MetricsEndpoint:
    """A worker process's one ``/metrics`` endpoint (its runtime owns it): started once, on one port."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.port: int | None = None

    def start(self, port: int | None, addr: str = "0.0.0.0", role: str | None = None) -> None:
        """Serve ``REGISTRY`` (only ``role``'s families when given) on ``port`` (no-op for None). A second call
        with the same port does nothing."""
        if port is None:
            return
        with self._lock:
            if self.port == port:
                return
            if self.port is not None:
                raise RuntimeError(
                    f"this process already serves metrics on port {self.port}; one endpoint per process "
                    f"(ASYNCGRPO_METRICS_PORT={port} asked for a second one)"
                )
            try:
                start_http_server(port, addr=addr, registry=role_registry(role) if role else REGISTRY)
            except OSError as error:
                raise OSError(
                    f"cannot serve worker metrics on {addr}:{port} ({error}); give each worker process its own "
                    "ASYNCGRPO_METRICS_PORT"
                ) from error
            self.port = port
        log.info("worker.metrics_started", port=port, addr=addr)


def set_worker_info(role: str, worker_id: str, device: str, backend: str) -> None:
    """Publish what this process is (``asyncgrpo_worker_info``); one label set per process."""
    if role not in ROLES:
        raise ValueError(f"worker role {role!r} is unknown; use one of {', '.join(ROLES)}")
    WORKER_INFO.info({"role": role, "worker_id": worker_id, "device": str(device), "backend": str(backend)})


def observe_error(kind: str) -> None:
    """Count one error of a bounded ``kind``; an unknown kind is counted as "other" (and logged)."""
    if kind not in ERROR_KINDS:
        log.warning("worker.metrics_unknown_error_kind", kind=kind, known=list(ERROR_KINDS))
        kind = "other"
    WORKER_ERRORS.labels(kind=kind).inc()


def observe_left_window() -> None:
    """Count one generate task handed back because its rollout left the window while it sampled."""
    GENERATE_TASKS_LEFT_WINDOW.inc()


def observe_idle(role: str, seconds: float) -> None:
    """Time a worker sat idle before its next task: rollout wait (optimize) or backpressure (generate)."""
    if seconds < 0 or not math.isfinite(seconds):
        raise ValueError(f"idle time must be a finite number of seconds >= 0, got {seconds!r}")
    if role == "optimize":
        TRAINER_ROLLOUT_WAIT_SECONDS.observe(seconds)
    elif role == "generate":
        GENERATE_BACKPRESSURE_SECONDS.observe(seconds)
    else:
        raise ValueError(f"worker role {role!r} is unknown; use one of {', '.join(ROLES)}")


@contextmanager
def task_in_flight(role: str) -> Iterator[None]:
    """Count a task as in flight on this worker while the block runs."""
    if role not in ROLES:
        raise ValueError(f"worker role {role!r} is unknown; use one of {', '.join(ROLES)}")
    gauge = WORKER_TASKS_IN_FLIGHT.labels(role=role)
    gauge.inc()
    try:
        yield
    finally:
        gauge.dec()


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _set(gauge: Gauge, value: float | None) -> None:
    number = _finite(value)
    if number is not None:
        gauge.set(number)


def _observe(histogram: Histogram, value: float | None) -> None:
    number = _finite(value)
    if number is not None and number >= 0:
        histogram.observe(number)


def observe_generate_task(result: GenerateResult) -> None:
    """Record one finished generate task."""
    if result.status not in GENERATE_STATUSES:
        log.warning("worker.metrics_unknown_generate_status", status=result.status)
    else:
        GENERATE_TASKS.labels(status=result.status).inc()
    if result.status == "stale":
        observe_error("stale")
    timings = result.timings
    _observe(GENERATE_TASK_SECONDS, timings.task_s)
    if result.reused_rollout:
        # A redelivered task resubmitted an earlier rollout: nothing was generated this time.
        return
    _observe(GENERATE_ADAPTER_FETCH_SECONDS, timings.adapter_fetch_s)
    _observe(GENERATE_SAMPLING_SECONDS, timings.generate_s)
    _observe(GENERATE_SCORING_SECONDS, timings.score_s)
    GENERATE_TOKENS.inc(result.tokens - result.tokens_resumed)
    GENERATE_TOKENS_RESUMED.inc(result.tokens_resumed)
    GENERATE_PARTIALS_DISCARDED.inc(result.partials_discarded)
    GENERATE_SAMPLES.inc(result.samples)
    GENERATE_GROUPS.inc(result.groups)
    sampling_s = _finite(timings.generate_s)
    if sampling_s:
        GENERATE_TOKENS_PER_SECOND.set((result.tokens - result.tokens_resumed) / sampling_s)
    task_s = _finite(timings.task_s)
    if task_s:
        GENERATE_SAMPLES_PER_SECOND.set(result.samples / task_s)
    GENERATE_VERSION.set(result.version)
    _set(GENERATE_REWARD_MEAN, result.reward_mean)


def observe_eval_task(status: str) -> None:
    """Count one finished eval task by its outcome."""
    if status not in EVAL_STATUSES:
        log.warning("worker.metrics_unknown_eval_status", status=status)
        return
    EVAL_TASKS.labels(status=status).inc()


def observe_optimize_step(record: StepRecord | None, status: str) -> None:
    """Record one finished optimize task: its ``status`` and, when it trained, its step record."""
    if status not in OPTIMIZE_STATUSES:
        log.warning("worker.metrics_unknown_optimize_status", status=status)
    else:
        TRAINER_STEPS.labels(status=status).inc()
    if status == "conflict":
        observe_error("conflict")
    if record is None:
        return
    timings = record.timings
    _observe(TRAINER_STEP_SECONDS, timings.step_s)
    _observe(TRAINER_FORWARD_BACKWARD_SECONDS, record.forward_backward_s)
    _observe(TRAINER_OPTIMIZER_SECONDS, record.optimizer_s)
    _observe(TRAINER_FETCH_SECONDS, timings.fetch_s)
    _observe(TRAINER_RESCORE_SECONDS, timings.rescore_s)
    _observe(TRAINER_PUBLISH_SECONDS, timings.upload_s)

    TRAINER_TOKENS.inc(record.tokens)
    TRAINER_SAMPLES.inc(record.samples)
    TRAINER_GROUPS.inc(record.groups)
    TRAINER_SAMPLES_PER_STEP.set(record.samples)
    TRAINER_GROUPS_PER_STEP.set(record.groups)
    step_s = _finite(timings.step_s)
    if step_s:
        TRAINER_TOKENS_PER_SECOND.set(record.tokens / step_s)
    TRAINER_VERSION.set(record.version)
    _set(TRAINER_LAST_PUBLISH_TIMESTAMP, record.published_at)

    for value in record.staleness_per_sample():
        SAMPLE_STALENESS_VERSIONS.observe(value)
    STEP_MAX_STALENESS_VERSIONS.set(record.max_staleness)
    _set(STEP_TOKEN_STALENESS_MEAN_VERSIONS, record.token_staleness_mean)
    _set(STEP_TOKEN_STALENESS_MAX_VERSIONS, record.token_staleness_max)
    if record.masked_stale_tokens:
        MASKED_STALE_TOKENS.inc(record.masked_stale_tokens)
    _observe_policy(record)


def _observe_policy(record: StepRecord) -> None:
    _set(POLICY_RATIO, record.ratio)
    _set(POLICY_RESCORE_RATIO, record.rescore_ratio)
    _set(POLICY_KL, record.kl)
    _set(POLICY_ENTROPY_NATS, record.entropy)
    _set(POLICY_CLIP_FRACTION.labels(bound="low"), record.clip_low)
    _set(POLICY_CLIP_FRACTION.labels(bound="high"), record.clip_high)
    _set(POLICY_CLIP_FRACTION.labels(bound="region"), record.clip_region)
    if record.importance_sampling_ratio is not None:
        figures = record.importance_sampling_ratio
        for stat in ("min", "mean", "max"):
            _set(POLICY_IMPORTANCE_SAMPLING_RATIO.labels(stat=stat), getattr(figures, stat))
        _set(POLICY_SAMPLING_LOGP_DIFFERENCE.labels(stat="mean"), figures.logp_difference_mean)
        _set(POLICY_SAMPLING_LOGP_DIFFERENCE.labels(stat="max"), figures.logp_difference_max)
    if record.tools is not None:
        _set(POLICY_TOOL_CALLS, record.tools.call_frequency)
        _set(POLICY_TOOL_FAILURE_RATIO, record.tools.failure_frequency)
        _set(POLICY_TURNS, record.tools.turns_mean)
    _set(POLICY_LOSS, record.loss)
    _set(POLICY_GRAD_NORM, record.grad_norm)
    _set(POLICY_LEARNING_RATE, record.lr)
    _set(POLICY_REWARD_MEAN, record.reward_mean)
    _set(POLICY_REWARD_STD, record.reward_std)
    for name, value in record.rewards_by_name.items():
        _set(POLICY_REWARD_FUNCTION_MEAN.labels(reward=name), value)
    for name, value in record.rewards_std_by_name.items():
        _set(POLICY_REWARD_FUNCTION_STD.labels(reward=name), value)
    _set(POLICY_COMPLETION_LENGTH_TOKENS, record.completion_length_mean)
    _set(POLICY_TRUNCATED_RATIO, record.truncated_fraction)
    if record.flagged_rollouts:
        POLICY_FLAGGED_ROLLOUTS.inc(len(record.flagged_rollouts))
