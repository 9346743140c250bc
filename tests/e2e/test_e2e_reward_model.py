"""A reward model as a reward, end to end: real proxy, generate and optimize workers on the tiny model, a real
bucket, and a tiny random-init sequence-classification model next to ``repeat_digit``. The generate worker loads
it at start and scores every completion with it; the step records carry its name with finite values, and a
rollout read back from the bucket holds exactly the scores a direct forward of the model gives its texts."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from asyncgrpo.bucket import layout as bucket_keys
from cli.local_cluster import LocalCluster
from tests.support.e2e_harness import assert_run_invariants, records_of, version_reached, wait_for
from tests.support.fixtures_s3 import open_env_bucket
from worker.algo.rollout import decode_rollout
from worker.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

STEPS = 3


def test_reward_model_scores_reach_rollouts_and_step_records(
    make_cluster: Callable[..., LocalCluster], tiny_reward_model_dir: Path, tiny_model_dir: Path
) -> None:
    extra = (
        "rollout_retention_versions = -1\n\n"
        f'[[rewards]]\nmodel = "{tiny_reward_model_dir}"\nname = "tiny-rm"\nweight = 0.01\nbatch_size = 5\n'
    )
    cluster = make_cluster(total_steps=STEPS, extra_toml=extra)
    cluster.start_worker("optimize", name="opt-1")
    cluster.start_worker("generate", name="gen-1")
    wait_for(version_reached(cluster, STEPS), 300, f"version {STEPS}", cluster)

    records = records_of(cluster)
    assert_run_invariants(records)
    assert len(records) >= STEPS
    for record in records:
        assert set(record.rewards_by_name) == {"repeat_digit", "tiny-rm"}
        assert math.isfinite(record.rewards_by_name["tiny-rm"])

    # One rollout read back: its model scores are a direct forward of the model on prompt + completion.
    bucket = open_env_bucket(cluster.bucket_url)
    key = sorted(bucket.list(bucket_keys.rollouts_prefix(cluster.run)))[0]
    rollout = decode_rollout(bucket.get(key))
    assert rollout.samples
    policy_tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    for sample in rollout.samples:
        completion = policy_tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True)
        text = rollout.extra.prompts[sample.group_index] + completion
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            direct = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
        assert sample.rewards_by_name["tiny-rm"] == pytest.approx(direct, abs=1e-4)
        assert sample.reward == pytest.approx(
            sample.rewards_by_name["repeat_digit"] + 0.01 * sample.rewards_by_name["tiny-rm"], abs=1e-6
        )
