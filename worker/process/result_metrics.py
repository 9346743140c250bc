"""Worker metrics moved by a finished task's result: ``GenerateResult`` on the generate side, the optimize
step's ``StepRecord`` (the same record as ``runs/<run>/metrics/step-S.json``) on the optimize side.

The families live in ``worker.process.metrics``; the tasks call these right after the plain function returns.
A figure that is None (a step with no tokens has no ratio) or not finite leaves its gauge as it was.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import structlog
from prometheus_client import Gauge, Histogram

from asyncgrpo.protocol.records import StepRecord
from worker.process import metrics as m

if TYPE_CHECKING:  # the generate job pulls in torch; only its result type is needed here
    from worker.generate.job import GenerateResult

log = structlog.get_logger()


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
    if result.status not in m.GENERATE_STATUSES:
        log.warning("worker.metrics_unknown_generate_status", status=result.status)
    else:
        m.GENERATE_TASKS.labels(status=result.status).inc()
    if result.status == "stale":
        m.observe_error("stale")
    timings = result.timings
    _observe(m.GENERATE_TASK_SECONDS, timings.task_s)
    if result.reused_rollout:
        # A redelivered task resubmitted an earlier rollout: nothing was generated this time.
        return
    _observe(m.GENERATE_ADAPTER_FETCH_SECONDS, timings.adapter_fetch_s)
    _observe(m.GENERATE_SAMPLING_SECONDS, timings.generate_s)
    _observe(m.GENERATE_SCORING_SECONDS, timings.score_s)
    m.GENERATE_TOKENS.inc(result.tokens)
    m.GENERATE_SAMPLES.inc(result.samples)
    m.GENERATE_GROUPS.inc(result.groups)
    sampling_s = _finite(timings.generate_s)
    if sampling_s:
        m.GENERATE_TOKENS_PER_SECOND.set(result.tokens / sampling_s)
    task_s = _finite(timings.task_s)
    if task_s:
        m.GENERATE_SAMPLES_PER_SECOND.set(result.samples / task_s)
    m.GENERATE_VERSION.set(result.version)
    _set(m.GENERATE_REWARD_MEAN, result.reward_mean)


def observe_optimize_step(record: StepRecord | None, status: str) -> None:
    """Record one finished optimize task: its ``status`` and, when it trained, its step record."""
    if status not in m.OPTIMIZE_STATUSES:
        log.warning("worker.metrics_unknown_optimize_status", status=status)
    else:
        m.TRAINER_STEPS.labels(status=status).inc()
    if status == "conflict":
        m.observe_error("conflict")
    if record is None:
        return
    timings = record.timings
    _observe(m.TRAINER_STEP_SECONDS, timings.step_s)
    _observe(m.TRAINER_FORWARD_BACKWARD_SECONDS, record.forward_backward_s)
    _observe(m.TRAINER_OPTIMIZER_SECONDS, record.optimizer_s)
    _observe(m.TRAINER_FETCH_SECONDS, timings.fetch_s)
    _observe(m.TRAINER_RESCORE_SECONDS, timings.rescore_s)
    _observe(m.TRAINER_PUBLISH_SECONDS, timings.upload_s)

    m.TRAINER_TOKENS.inc(record.tokens)
    m.TRAINER_SAMPLES.inc(record.samples)
    m.TRAINER_GROUPS.inc(record.groups)
    m.TRAINER_SAMPLES_PER_STEP.set(record.samples)
    m.TRAINER_GROUPS_PER_STEP.set(record.groups)
    step_s = _finite(timings.step_s)
    if step_s:
        m.TRAINER_TOKENS_PER_SECOND.set(record.tokens / step_s)
    m.TRAINER_VERSION.set(record.version)
    _set(m.TRAINER_LAST_PUBLISH_TIMESTAMP, record.published_at)

    for value in record.staleness_per_sample():
        m.SAMPLE_STALENESS_VERSIONS.observe(value)
    m.STEP_MAX_STALENESS_VERSIONS.set(record.max_staleness)
    _observe_policy(record)


def _observe_policy(record: StepRecord) -> None:
    _set(m.POLICY_RATIO, record.ratio)
    _set(m.POLICY_RESCORE_RATIO, record.rescore_ratio)
    _set(m.POLICY_KL, record.kl)
    _set(m.POLICY_ENTROPY_NATS, record.entropy)
    _set(m.POLICY_CLIP_FRACTION.labels(bound="low"), record.clip_low)
    _set(m.POLICY_CLIP_FRACTION.labels(bound="high"), record.clip_high)
    _set(m.POLICY_CLIP_FRACTION.labels(bound="region"), record.clip_region)
    _set(m.POLICY_LOSS, record.loss)
    _set(m.POLICY_GRAD_NORM, record.grad_norm)
    _set(m.POLICY_LEARNING_RATE, record.lr)
    _set(m.POLICY_REWARD_MEAN, record.reward_mean)
    _set(m.POLICY_REWARD_STD, record.reward_std)
    for name, value in record.rewards_by_name.items():
        _set(m.POLICY_REWARD_FUNCTION_MEAN.labels(reward=name), value)
    for name, value in record.rewards_std_by_name.items():
        _set(m.POLICY_REWARD_FUNCTION_STD.labels(reward=name), value)
    _set(m.POLICY_COMPLETION_LENGTH_TOKENS, record.completion_length_mean)
    _set(m.POLICY_TRUNCATED_RATIO, record.truncated_fraction)
    if record.flagged_rollouts:
        m.POLICY_FLAGGED_ROLLOUTS.inc(len(record.flagged_rollouts))
