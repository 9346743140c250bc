"""The trainer's side of poison steps: which rollout is unusable and why, before any training."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.bucket.layout import sha256_hex
from asyncgrpo.protocol.schemas import GroupRef, RolloutRef
from worker.algo.grpo import NonFiniteError
from worker.algo.rollout import Rollout, RolloutSample, encode_rollout
from worker.optimize.job import RolloutUnusable, _fetch_rollouts, step_failure_of, validate_rollout

RUN = "r1"


def rollout(task_id: str, logprob: float = -0.5, advantage: float = 1.0) -> Rollout:
    samples = [
        RolloutSample(
            group_index=0,
            prompt_token_ids=[1, 2],
            completion_token_ids=[3, 4],
            behavior_logprobs=[-0.1, logprob],
            reward=1.0,
            advantage=advantage,
            finish_reason="stop",
        )
    ]
    return Rollout(RUN, task_id, 0, "gen-1", [GroupRef(group_id=f"{task_id}.0", prompt_index=0)], samples)


def stored(tmp_path: Path, *rollouts: Rollout) -> tuple[Bucket, list[RolloutRef]]:
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    refs = []
    for item in rollouts:
        data = encode_rollout(item)
        key = bucket_keys.rollout_key(RUN, item.task_id)
        bucket.put(key, data)
        refs.append(
            RolloutRef(
                task_id=item.task_id, key=key, sha256=sha256_hex(data), version=0, group_ids=[f"{item.task_id}.0"]
            )
        )
    return bucket, refs


@pytest.mark.parametrize("field", ["logprob", "advantage"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_values_name_their_rollout(field: str, value: float) -> None:
    validate_rollout(rollout("t-ok"))
    with pytest.raises(RolloutUnusable) as caught:
        validate_rollout(rollout("t-bad", **{field: value}))
    report = caught.value.report("opt-1")
    assert (report.kind, report.reason, report.task_id) == ("rollout", "rollout_non_finite", "t-bad")


def test_a_malformed_sample_names_its_rollout() -> None:
    bad = rollout("t-bad")
    bad.samples[0].behavior_logprobs = [-0.1]
    with pytest.raises(RolloutUnusable, match="t-bad") as caught:
        validate_rollout(bad)
    assert caught.value.reason == "rollout_malformed"


def test_an_overwritten_or_missing_rollout_object_is_named(tmp_path: Path) -> None:
    bucket, refs = stored(tmp_path, rollout("t-1"), rollout("t-2"))
    assert [r.task_id for r in _fetch_rollouts(bucket, refs)] == ["t-1", "t-2"]
    bucket.put(refs[1].key, b"other bytes")
    with pytest.raises(RolloutUnusable) as caught:
        _fetch_rollouts(bucket, refs)
    assert (caught.value.task_id, caught.value.reason) == ("t-2", "rollout_integrity")
    bucket.delete(refs[0].key)
    with pytest.raises(RolloutUnusable) as caught:
        _fetch_rollouts(bucket, refs)
    assert (caught.value.task_id, caught.value.reason) == ("t-1", "rollout_missing")


def test_a_nan_logprob_in_a_stored_rollout_stops_the_fetch(tmp_path: Path) -> None:
    bucket, refs = stored(tmp_path, rollout("t-1"), rollout("t-nan", logprob=math.nan))
    with pytest.raises(RolloutUnusable) as caught:
        _fetch_rollouts(bucket, refs)
    assert caught.value.task_id == "t-nan"


def test_a_non_finite_gradient_counts_as_a_step_attempt_and_other_errors_are_not_reported() -> None:
    failure = step_failure_of(NonFiniteError("gradient norm is nan"))
    assert failure is not None and failure.report("opt-1").model_dump()["kind"] == "step"
    assert failure.reason == "non_finite_gradient"
    assert step_failure_of(RuntimeError("a bug")) is None
