"""The bucket key layout: one function per key, names checked, versions sortable as text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import check_key


def test_layout_of_one_run() -> None:
    assert bucket_keys.config_key("r") == "runs/r/config.json"
    assert bucket_keys.run_manifest_key("r") == "runs/r/RUN_MANIFEST.json"
    assert bucket_keys.prompts_key("r") == "runs/r/prompts/prompts.jsonl"
    assert bucket_keys.adapter_prefix("r", 42) == "runs/r/adapters/v00000042/"
    assert bucket_keys.manifest_key("r", 42) == "runs/r/adapters/v00000042/MANIFEST.json"
    assert (
        bucket_keys.adapter_file_key("r", 42, bucket_keys.ADAPTER_WEIGHTS_NAME)
        == "runs/r/adapters/v00000042/adapter_model.safetensors"
    )
    assert bucket_keys.rollout_key("r", "gen-7") == "runs/r/rollouts/gen-7.safetensors"
    assert bucket_keys.metrics_key("r", 42) == "runs/r/metrics/step-00000042.json"
    assert bucket_keys.proxy_snapshot_key("r") == "runs/r/proxy/snapshot.json"
    assert bucket_keys.adapter_name(42) == "v42"


@pytest.mark.parametrize("run", ["", "-lead", "a/b", "a b", "..", "x" * 65, "run\n"])
def test_bad_run_names_are_refused_with_the_rule(run: str) -> None:
    with pytest.raises(bucket_keys.InvalidKeyPart, match="run name"):
        bucket_keys.config_key(run)


@pytest.mark.parametrize("task_id", ["", "a/b", "../x", "a b", "t1\n"])
def test_bad_task_ids_are_refused(task_id: str) -> None:
    with pytest.raises(bucket_keys.InvalidKeyPart, match="task id"):
        bucket_keys.rollout_key("r", task_id)


def test_bad_adapter_file_names_and_versions() -> None:
    with pytest.raises(bucket_keys.InvalidKeyPart, match="plain file name"):
        bucket_keys.adapter_file_key("r", 1, "../x")
    with pytest.raises(ValueError, match=">= 0"):
        bucket_keys.adapter_prefix("r", -1)


@given(st.lists(st.integers(min_value=0, max_value=99_999_999), min_size=2, max_size=20, unique=True))
def test_version_prefixes_sort_numerically_and_parse_back(versions: list[int]) -> None:
    prefixes = [bucket_keys.adapter_prefix("r", v) for v in versions]
    assert [bucket_keys.version_from_adapter_prefix(p) for p in sorted(prefixes)] == sorted(versions)


def test_version_from_other_prefixes_is_none() -> None:
    assert bucket_keys.version_from_adapter_prefix("runs/r/rollouts/") is None
    assert bucket_keys.version_from_adapter_prefix("runs/r/adapters/v42/") is None


_RUN_NAMES = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,20}\Z")


@given(_RUN_NAMES, st.integers(min_value=0, max_value=10**6))
def test_every_built_key_is_a_valid_bucket_key(run: str, version: int) -> None:
    for key in (
        bucket_keys.config_key(run),
        bucket_keys.prompts_key(run),
        bucket_keys.run_manifest_key(run),
        bucket_keys.manifest_key(run, version),
        bucket_keys.metrics_key(run, version),
        bucket_keys.rollout_key(run, f"t{version}"),
        bucket_keys.proxy_snapshot_key(run),
    ):
        # Run names such as "." or ".." cannot slip through into a key.
        assert check_key(key) == key
