"""The stored records keep the JSON keys written before they were typed, so existing buckets still read, and
a record that does not parse is skipped by name instead of hiding the run's history."""

from __future__ import annotations

import json
from pathlib import Path

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import open_bucket
from asyncgrpo.protocol.records import RolloutHeader, StepRecord
from cli.history import load_step_records

# As the untyped writers wrote them (worker/optimize/job.py and worker/algo/rollout.py before the models).
OLD_HEADER = {
    "format": 1,
    "run": "r1",
    "task_id": "t1",
    "version": 3,
    "worker_id": "gen-1",
    "groups": [{"group_id": "t1.0", "prompt_index": 4}],
    "finish_reasons": ["stop", "length"],
    "reward_names": ["repeat_digit"],
    "rewards": [1.0, 0.5],
    "timings": {"adapter_fetch_s": 0.01, "generate_s": 1.5, "score_s": 0.02},
    "extra": {"rejected_groups": [{"group_id": "t1.1", "reason": "prompt 9 out of range"}]},
}
OLD_STEP_RECORD = {
    "run": "r1",
    "step": 4,
    "version": 4,
    "base_version": 3,
    "worker_id": "opt-1",
    "published_at": 1.7e9,
    "samples": 2,
    "groups": 1,
    "tokens": 9,
    "reward_mean": 0.75,
    "reward_std": 0.25,
    "rewards_by_name": {"repeat_digit": 0.75},
    "rewards_std_by_name": {"repeat_digit": 0.25},
    "completion_length_mean": 4.5,
    "truncated_fraction": 0.5,
    "staleness": [1],
    "max_staleness": 1,
    "ratio": 1.0,
    "rescore_ratio": 1.0,
    "kl": 0.001,
    "entropy": 1.2,
    "clip_low": 0.0,
    "clip_high": 0.01,
    "clip_region": 0.01,
    "loss": 0.1,
    "grad_norm": 0.5,
    "lr": 1e-3,
    "updates": [
        {
            "update": 3,
            "loss": 0.1,
            "ratio": 1.0,
            "kl": 0.001,
            "clip_low": 0.0,
            "clip_high": 0.01,
            "clip_region": 0.01,
            "entropy": 1.2,
            "grad_norm": 0.5,
            "lr": 1e-3,
            "tokens": 9,
            "sequences": 2,
            "micro_batches": 1,
            "forward_backward_s": 0.2,
            "optimizer_s": 0.01,
            "kl_ref": None,
        }
    ],
    "rollouts": [
        {
            "task_id": "t1",
            "version": 3,
            "worker_id": "gen-1",
            "ratio": 1.0,
            "group_ids": ["t1.0"],
            "prompt_indices": [4],
            "samples": 2,
        }
    ],
    "flagged_rollouts": [{"task_id": "t1", "worker_id": "gen-1", "ratio": 1.3}],
    "timings": {"fetch_s": 0.01, "rescore_s": 0.1, "step_s": 0.9},
}


def test_rollout_header_reads_and_writes_the_old_keys() -> None:
    header = RolloutHeader.model_validate_json(json.dumps(OLD_HEADER))
    assert header.groups[0].prompt_index == 4 and header.extra.rejected_groups[0].group_id == "t1.1"
    assert header.model_dump(mode="json") == OLD_HEADER


def test_step_record_reads_and_writes_the_old_keys() -> None:
    record = StepRecord.model_validate_json(json.dumps(OLD_STEP_RECORD))
    assert record.rollouts[0].group_ids == ["t1.0"] and record.flagged_rollouts[0].ratio == 1.3
    assert record.forward_backward_s == 0.2 and record.staleness_per_sample() == [1, 1]
    assert record.model_dump(mode="json") == OLD_STEP_RECORD


def test_a_record_that_does_not_parse_is_skipped_by_key(tmp_path: Path) -> None:
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    bucket.put(bucket_keys.metrics_key("r1", 4), json.dumps(OLD_STEP_RECORD).encode())
    bucket.put(bucket_keys.metrics_key("r1", 5), json.dumps({"step": 5}).encode())
    bucket.put(bucket_keys.metrics_key("r1", 6), b"{not json")
    with structlog.testing.capture_logs() as logs:
        records = load_step_records(bucket, "r1")
    assert [record.step for record in records] == [4]
    skipped = [line["key"] for line in logs if "skipped" in line["event"]]
    assert skipped == [bucket_keys.metrics_key("r1", 5), bucket_keys.metrics_key("r1", 6)]
