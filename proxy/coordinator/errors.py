"""Every refusal of the coordinator, one exception per non-OK return code of its Lua scripts.

The API maps each refusal a worker can meet to an HTTP status and error code; the worker's client maps the
code back to its own exception, so a refusal keeps its meaning across the wire. The declarations of
``proxy.coordinator.scripts`` name the exception of each code; the last group below are answers the
coordinator handles itself (they never reach the API).
"""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base of every refusal by the coordinator."""


class StateMissing(CoordinatorError):
    """Redis holds no state for the run (it was flushed or restarted empty); the run must be rebuilt."""


class NoVersionYet(CoordinatorError):
    """No version is published yet (the init step has not finished); nothing can be leased."""


class LeaseLostError(CoordinatorError):
    """The lease expired or never existed; the version it named may be collected."""


class TaskCancelled(CoordinatorError):
    """The generate task timed out or was superseded; its groups were already requeued."""


class UnknownTask(TaskCancelled):
    """The proxy never dispatched this task (or forgot it in a rebuild); its work is not wanted."""


class TaskEnded(TaskCancelled):
    """A lease asked for a generate task that is no longer in flight (cancelled, submitted, or forgotten):
    the worker skips the task and acks its message."""


class EvalEnded(TaskCancelled):
    """An evaluate task whose version is evaluated already or was given up (or an unknown one): the worker
    drops it."""


class BadRollout(CoordinatorError):
    """A submission that does not match its task (foreign or repeated groups, a future version, a bad key)."""


class NotTaskHolder(CoordinatorError):
    """A submission not bound to its lease: the task was never leased, another worker holds it, the version
    (or lease) is not one its holder leased for it, or another rollout was admitted for it. Nothing changed;
    the worker drops its work (the task is someone else's, or already done), reporting no failure."""


class StepNotFound(CoordinatorError):
    """No step with this number was claimed."""


class PublishConflict(CoordinatorError):
    """A publish that must not happen; the version is unchanged. Subclasses say why."""

    def __init__(self, message: str, current_version: int) -> None:
        super().__init__(message)
        self.current_version = current_version


class CasLost(PublishConflict):
    """``current != base_version``: another trainer published first (or this one is a zombie)."""


class BadVersionNumber(PublishConflict):
    """``version`` is not ``base_version + 1`` or ``step`` is not ``version``."""


class StepNotClaimed(PublishConflict):
    """No claimed step of this number starts from ``base_version``."""


class ManifestMissing(PublishConflict):
    """The version's MANIFEST.json is not in the bucket: the upload is incomplete."""


class ManifestMismatch(PublishConflict):
    """The manifest in the bucket is not the one the trainer says it wrote."""


class SnapshotFailed(CoordinatorError):
    """The snapshot could not be written to the bucket; the change is in Redis but not yet durable."""


class RolloutTooStale(CoordinatorError):
    """SUBMIT_ROLLOUT refused a rollout as too stale (its groups were requeued); the coordinator raises the
    protocol's ``StaleRolloutError`` in its place, which names the versions and the knob to change."""

    def __init__(self, message: str, current: int) -> None:
        super().__init__(message)
        self.current = int(current)


# ---- answers the coordinator handles itself ----


class BufferFull(CoordinatorError):
    """In-flight plus buffered groups would pass ``async.queue_maxsize``: no generate task now."""


class EpochMoved(CoordinatorError):
    """The prompt order position moved between reading it and dispatching; read it again."""


class StepNotReady(CoordinatorError):
    """No step can be claimed now (one is in flight, or too few groups are buffered)."""

    def __init__(self, message: str, dropped: int) -> None:
        super().__init__(message)
        self.dropped = int(dropped)
        """Groups dropped as too stale on the way (a change even though nothing was claimed)."""


class StepNoLongerClaimed(CoordinatorError):
    """The step was published (or forgotten) between reading it and marking its optimize task sent."""


class BadStepFailure(CoordinatorError):
    """A step failure report that does not match the step (it names a rollout outside the batch)."""


class StateExists(CoordinatorError):
    """A restore found the run's state already in Redis (another restore won); nothing was written."""


class VersionNotFound(StepNotFound):
    """No published version with this number is recorded (never published, or collected)."""
