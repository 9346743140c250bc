"""The staleness rule, in one place: the proxy (at admit and at claim) and the trainer both call it.

A sample generated with policy version ``n`` and trained in an optimizer step that starts from version
``c`` has staleness ``c - n``. It may be used iff ``c - n <= max_staleness`` (config field
``async.max_staleness``). A sample from a version newer than ``c`` cannot exist; asking about one is a bug
and raises ``ValueError``.
"""

from __future__ import annotations


class StaleRolloutError(Exception):
    """A sample is too old to be used in a gradient step; the message says what to change."""

    def __init__(self, sample_version: int, current: int, max_staleness: int) -> None:
        self.sample_version = sample_version
        self.current = current
        self.max_staleness = max_staleness
        self.behind = current - sample_version
        super().__init__(
            f"rollout v{sample_version} is {self.behind} versions behind v{current} "
            f"(async.max_staleness={max_staleness}); add generate workers or raise async.max_staleness"
        )


def staleness(current: int, sample_version: int) -> int:
    """How many versions the sample lags behind ``current`` (0: made with the current policy)."""
    if sample_version < 0:
        raise ValueError(f"sample version must be >= 0, got {sample_version}")
    if sample_version > current:
        raise ValueError(
            f"sample version v{sample_version} is newer than the current version v{current}: "
            "no such policy was published"
        )
    return current - sample_version


def is_fresh(current: int, sample_version: int, max_staleness: int) -> bool:
    """True iff a sample of ``sample_version`` may train a step that starts from ``current``."""
    if max_staleness < 0:
        raise ValueError(f"async.max_staleness must be >= 0, got {max_staleness}")
    return staleness(current, sample_version) <= max_staleness


def check_fresh(current: int, sample_version: int, max_staleness: int) -> None:
    """Raise :class:`StaleRolloutError` unless the sample is fresh enough."""
    if not is_fresh(current, sample_version, max_staleness):
        raise StaleRolloutError(sample_version, current, max_staleness)
