"""The staleness rule: pure, shared by the proxy and the trainer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.protocol.schemas import StaleRolloutError, check_fresh, is_fresh, staleness


def test_staleness_counts_versions_behind() -> None:
    assert staleness(17, 12) == 5
    assert staleness(3, 3) == 0


def test_boundary_is_inclusive() -> None:
    assert is_fresh(10, 8, max_staleness=2)
    assert not is_fresh(10, 7, max_staleness=2)
    assert is_fresh(5, 5, max_staleness=0)
    assert not is_fresh(5, 4, max_staleness=0)


def test_future_or_negative_versions_are_errors() -> None:
    with pytest.raises(ValueError, match="newer than the current version"):
        staleness(3, 4)
    with pytest.raises(ValueError, match=">= 0"):
        staleness(3, -1)
    with pytest.raises(ValueError, match="max_staleness"):
        is_fresh(3, 3, -1)


def test_error_message_says_what_to_change() -> None:
    with pytest.raises(StaleRolloutError) as caught:
        check_fresh(17, 12, 4)
    message = str(caught.value)
    assert "rollout v12 is 5 versions behind v17 (async.max_staleness=4)" in message
    assert "add generate workers or raise async.max_staleness" in message
    assert (caught.value.behind, caught.value.current, caught.value.sample_version) == (5, 17, 12)
    check_fresh(17, 13, 4)  # fresh: no error


@given(current=st.integers(0, 10_000), lag=st.integers(0, 200), max_staleness=st.integers(0, 64))
def test_fresh_iff_lag_within_bound(current: int, lag: int, max_staleness: int) -> None:
    sample = max(0, current - lag)
    assert is_fresh(current, sample, max_staleness) == (current - sample <= max_staleness)
