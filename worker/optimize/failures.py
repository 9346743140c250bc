"""Why an optimize task could not train its step, as the proxy's failure report names it (invariant 9).

The job raises one of these (or the trainer's ``NonFiniteError``); the Celery task reports it with
``POST /v1/steps/{S}/failure`` and ends acknowledged, so the proxy -- not a retry loop -- decides what
happens next: a named rollout is rejected and the step claimed again without it, a step failure counts an
attempt, an unloadable base goes to another trainer or halts the run.
"""

from __future__ import annotations

import math

from asyncgrpo.protocol.schemas import StepFailureKind, StepFailureReport
from worker.algo.grpo import NonFiniteError
from worker.algo.rollout import Rollout


class StepFailure(Exception):
    """The step cannot be trained by this attempt; ``kind``/``reason``/``task_id`` as the report carries them."""

    kind: StepFailureKind = "step"

    def __init__(self, reason: str, detail: str, task_id: str | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.task_id = task_id

    def report(self, worker_id: str) -> StepFailureReport:
        return StepFailureReport(
            worker_id=worker_id, kind=self.kind, reason=self.reason, detail=self.detail[:4000], task_id=self.task_id
        )


class RolloutUnusable(StepFailure):
    """A claimed rollout the trainer cannot use: missing, failing its sha256, malformed or non-finite."""

    kind: StepFailureKind = "rollout"

    def __init__(self, task_id: str, reason: str, detail: str) -> None:
        super().__init__(reason, f"rollout {task_id}: {detail}", task_id)


class BaseUnloadable(StepFailure):
    """The step's base version cannot be loaded from the bucket (its files fail their check, or are gone)."""

    kind: StepFailureKind = "base"


class ForeignUpload(StepFailure):
    """The step's version already has a manifest made from another batch, not yet published: an attempt from
    before the step was claimed again. The proxy removes it and re-sends the step."""

    kind: StepFailureKind = "upload"


def step_failure_of(error: BaseException) -> StepFailure | None:
    """The failure to report for ``error``, or None if it is not a step failure (a bug, a transient error)."""
    if isinstance(error, StepFailure):
        return error
    if isinstance(error, NonFiniteError):
        # Deterministic for a given batch and base: counted as an attempt, the batch rejected at the limit.
        return StepFailure("non_finite_gradient", str(error))
    return None


def _finite(values: list[float]) -> bool:
    return all(math.isfinite(value) for value in values)


def validate_rollout(rollout: Rollout) -> None:
    """Raise RolloutUnusable unless every sample is well formed and finite (before any training)."""
    groups = len(rollout.groups)
    for index, sample in enumerate(rollout.samples):
        where = f"sample {index}"
        if not sample.prompt_token_ids or len(sample.completion_token_ids) != len(sample.behavior_logprobs):
            raise RolloutUnusable(
                rollout.task_id,
                "rollout_malformed",
                f"{where} has {len(sample.prompt_token_ids)} prompt tokens, {len(sample.completion_token_ids)} "
                f"completion tokens and {len(sample.behavior_logprobs)} behaviour logprobs",
            )
        if not 0 <= sample.group_index < groups:
            raise RolloutUnusable(
                rollout.task_id, "rollout_malformed", f"{where} names group {sample.group_index} of {groups}"
            )
        if not _finite(sample.behavior_logprobs):
            raise RolloutUnusable(rollout.task_id, "rollout_non_finite", f"{where} has non-finite logprobs")
        if not _finite([sample.advantage, sample.reward]):
            raise RolloutUnusable(
                rollout.task_id,
                "rollout_non_finite",
                f"{where} has advantage {sample.advantage} and reward {sample.reward}",
            )
