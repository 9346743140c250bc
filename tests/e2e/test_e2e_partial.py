"""Partial rollouts with real processes (``async.partial_rollouts``): a generate worker stopped mid-sampling by a
SIGTERM, or killed with ``kill -9``, has its saved sequences continued by the next worker, not sampled again.
The tests count the regenerated tokens: none of the saved ones."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from cli.local_cluster import ChildProcess, LocalCluster
from tests.support.e2e_harness import (
    PAUSE_SETTLE_S,
    assert_run_invariants,
    records_of,
    version_reached,
    wait_for,
)
from tests.support.fixtures_s3 import open_env_bucket
from worker.algo.rollout import decode_rollout, read_rollout_header
from worker.generate.partial import StoredPartial, decode_partial

pytestmark = pytest.mark.slow

SAMPLES = 16  # long enough a tail that a task spends most of its time sampling
# Saves every 50 ms (the default is 10 s: tests/unit/worker/test_partial.py shows it), so the test can pause
# a worker while it samples; rollouts kept so the test can read the one that continued the saved sequences.
PARTIAL_TOML = "partial_save_every_s = 0.05\nrollout_retention_versions = -1\n"


def _saved(bucket: Bucket, run: str) -> dict[int, StoredPartial]:
    saved = {}
    for key in bucket.list(bucket_keys.partials_prefix(run)):
        partial = decode_partial(bucket.get(key))
        saved[partial.prompt_index] = partial
    return saved


def _pause_while_saved(cluster: LocalCluster, child: ChildProcess, bucket: Bucket) -> None:
    """SIGSTOP the worker while saved sequences of its task are in the bucket (it is sampling, or just done)."""
    prefix = bucket_keys.partials_prefix(cluster.run)
    for _ in range(40):
        wait_for(lambda: bucket.list(prefix), 120, "a generate task to save its sequences", cluster)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(PAUSE_SETTLE_S)  # a write sent just before the stop lands
        if bucket.list(prefix):
            return
        os.kill(child.pid, signal.SIGCONT)  # it wrote its rollout meanwhile: the next task
    raise AssertionError("could not pause the worker while its sequences were saved")


def _continued(bucket: Bucket, run: str, saved: dict[int, StoredPartial]) -> Callable[[], dict | None]:
    """The rollouts that continued the saved groups, by prompt, once every saved group is in one."""
    seen: dict[str, object] = {}

    def found() -> dict | None:
        for key in bucket.list(bucket_keys.rollouts_prefix(run)):
            if key not in seen:
                data = bucket.get(key)
                seen[key] = decode_rollout(data) if read_rollout_header(data).extra.resumed_tokens else None
        by_prompt = {}
        for rollout in seen.values():
            for index, group in enumerate(getattr(rollout, "groups", [])):
                if group.prompt_index in saved:
                    by_prompt[group.prompt_index] = [s for s in rollout.samples if s.group_index == index]  # type: ignore[attr-defined]
        return by_prompt if by_prompt.keys() == saved.keys() else None

    return found


def _regenerated(saved: dict[int, StoredPartial], continued: dict) -> int:
    """Saved tokens that the continuing rollout does not hold as they were saved (sampled again)."""
    regenerated = 0
    for prompt, partial in saved.items():
        for sequence, sample in zip(partial.sequences, continued[prompt], strict=True):
            if sequence is None:
                continue
            length = len(sequence.token_ids)
            same_tokens = sample.completion_token_ids[:length] == sequence.token_ids
            same_logprobs = sample.behavior_logprobs[:length] == pytest.approx(sequence.logprobs, abs=1e-5)
            if not (same_tokens and same_logprobs):
                regenerated += length
    return regenerated


# The handed-back message goes to the back of the queue: the tasks dispatched before it run first, and the version
# moves on meanwhile. With stale_tokens = "mask" its saved tokens are continued (and masked if they fell out of the
# window) whatever that ordering; "drop" discards a saved group older than the window (tests/unit/worker).
SIGTERM_TOML = PARTIAL_TOML + 'stale_tokens = "mask"\n'


def test_a_sigterm_mid_sampling_loses_no_token(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(visibility_timeout_s=600, max_len=256, samples_per_prompt=SAMPLES, extra_toml=SIGTERM_TOML)
    bucket = open_env_bucket(cluster.bucket_url)
    cluster.start_worker("optimize", name="opt-1")
    victim = cluster.start_worker("generate", name="gen-a", env={"ASYNCGRPO_SOFT_SHUTDOWN_S": "0"})
    wait_for(version_reached(cluster, 1), 240, "version 1", cluster)
    stopped_itself = False
    for attempt in range(3):
        _pause_while_saved(cluster, victim, bucket)
        cluster.expect_dead(victim)
        victim.popen.send_signal(signal.SIGTERM)
        os.kill(victim.pid, signal.SIGCONT)
        assert victim.popen.wait(timeout=60) == 0, victim.log_tail()
        # It stopped at its next decode step and saved: unless the pause fell after its last decode step.
        stopped_itself = "generate.partial_saved_on_stop" in victim.log_tail(200)
        if stopped_itself:
            break
        victim = cluster.start_worker("generate", name=f"gen-a{attempt}", env={"ASYNCGRPO_SOFT_SHUTDOWN_S": "0"})
    assert stopped_itself, "no SIGTERM landed while a task sampled in three tries"
    saved = _saved(bucket, cluster.run)  # what it had sampled when it stopped
    assert saved and all(p.sequences for p in saved.values())
    saved_tokens = sum(len(s.token_ids) for p in saved.values() for s in p.sequences if s is not None)

    cluster.start_worker("generate", name="gen-b")
    continued = wait_for(_continued(bucket, cluster.run, saved), 120, "the saved sequences continued", cluster)
    assert _regenerated(saved, continued) == 0, f"of {saved_tokens} saved tokens"
    wait_for(lambda: not bucket.list(bucket_keys.partials_prefix(cluster.run)), 60, "saved groups deleted", cluster)
    assert_run_invariants(records_of(cluster))
    # Handed back, not lost: no task was cancelled as a dead worker's (which counts an attempt against its prompts).
    counters = cluster.status()["counters"]
    assert counters.get("tasks_worker_lost", 0) == 0 and counters.get("tasks_cancelled", 0) == 0


def test_a_kill_9_mid_sampling_loses_only_what_came_after_the_last_save(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(max_len=256, samples_per_prompt=SAMPLES, extra_toml=PARTIAL_TOML)
    bucket = open_env_bucket(cluster.bucket_url)
    cluster.start_worker("optimize", name="opt-1")
    victim = cluster.start_worker("generate", name="gen-a")
    wait_for(version_reached(cluster, 1), 240, "version 1", cluster)
    _pause_while_saved(cluster, victim, bucket)
    saved = _saved(bucket, cluster.run)  # its last save before the kill: the worker is paused
    cluster.expect_dead(victim)
    victim.kill_hard()
    saved_tokens = sum(len(s.token_ids) for p in saved.values() for s in p.sequences if s is not None)
    assert saved_tokens > 0

    cluster.start_worker("generate", name="gen-b")
    continued = wait_for(_continued(bucket, cluster.run, saved), 180, "the saved sequences continued", cluster)
    assert _regenerated(saved, continued) == 0, f"of {saved_tokens} saved tokens"
    wait_for(version_reached(cluster, cluster.status()["current_version"] + 1), 180, "the run to go on", cluster)
    assert_run_invariants(records_of(cluster))
