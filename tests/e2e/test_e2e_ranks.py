"""End-to-end, an optimize worker of 2 ranks (gloo, CPU: ``asyncgrpo worker optimize --nproc-per-node 2``) with a
real Redis, proxy, SeaweedFS bucket and generate worker: it trains the run to its final version, each published
update is the one a single-rank trainer computes from the same base and batch, and kill -9 of one rank ends
the whole worker at once and the step is recovered as a single-device worker's is (with every shipped
timeout)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import httpx
import psutil
import pytest
import torch

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.layout import read_verified, read_version_files
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.run.creation import load_run
from cli.local_cluster import ChildProcess, LocalCluster
from tests.support.e2e_harness import (
    assert_run_invariants,
    records_of,
    version_reached,
    wait_for,
    working_on,
)
from tests.support.fixtures_s3 import open_env_bucket
from worker.algo.rollout import decode_rollout
from worker.model.policy import Policy
from worker.optimize.batch import build_train_samples
from worker.optimize.trainer import Trainer

pytestmark = pytest.mark.slow

FINAL = 30  # steps of the learning run: the toy task's reward visibly rises within them
UPDATE_TOLERANCE = 1e-5


def _rank_processes(worker: ChildProcess) -> dict[int, psutil.Process]:
    """The worker's rank processes by rank (children of its launcher, which the test process started)."""
    found = {}
    for child in psutil.Process(worker.pid).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None:
            found[int(rank)] = child
    return found


def _alive(cluster: LocalCluster, worker_id: str) -> bool:
    auth = {"Authorization": f"Bearer {cluster.token}"}
    workers = httpx.get(f"{cluster.proxy_url}/v1/workers", headers=auth, timeout=5).json()["workers"]
    return any(w["worker_id"] == worker_id and w["alive"] for w in workers)


def _replayed_on_one_rank(cluster: LocalCluster, step: int) -> tuple[Trainer, list[torch.Tensor]]:
    """Step ``step`` trained again by a single-rank trainer from its published base and its own batch; returns
    the trainer and the published version's LoRA tensors (in the trainer's parameter order)."""
    bucket = open_env_bucket(cluster.bucket_url)
    client = ProxyClient(cluster.proxy_url, cluster.token)
    config, _, _ = load_run(bucket, cluster.run)
    record = next(r for r in records_of(cluster) if r.step == step)
    trainer = Trainer.initial(Policy.load(config.model.base, config.model.dtype, "cpu"), config)
    _, _, base = read_version_files(
        bucket, cluster.run, step - 1, client.version_info(step - 1).manifest_sha256, skip=("step_record.json",)
    )
    trainer.load_version_files(base)
    # The claimed rollouts in claim order (the record keeps it), as the optimize job reads them.
    rollouts = []
    for entry in record.rollouts:
        key = bucket_keys.rollout_key(cluster.run, entry.task_id)
        data = bucket.get(key)
        rollouts.append(decode_rollout(data))
    samples, _ = build_train_samples(rollouts)
    trainer.step(samples)
    _, _, published = read_version_files(
        bucket, cluster.run, step, client.version_info(step).manifest_sha256, skip=("step_record.json",)
    )
    return trainer, trainer.lora_values(published[bucket_keys.ADAPTER_WEIGHTS_NAME])


def test_a_2_rank_optimize_worker_trains_the_run_to_its_end_as_one_rank_would(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(total_steps=FINAL)
    trainer = cluster.start_worker("optimize", name="opt-ranks", nproc_per_node=2)
    cluster.start_worker("generate", name="gen-1")
    wait_for(lambda: len(_rank_processes(trainer)) == 2, 60, "both ranks of opt-ranks", cluster)
    wait_for(version_reached(cluster, FINAL), 600, f"the final version {FINAL}", cluster)

    records = records_of(cluster)
    assert_run_invariants(records)
    assert {r.worker_id for r in records} == {"opt-ranks"}
    # It learns: the toy reward of the last third of the run is above the first third's.
    third = FINAL // 3
    early = sum(r.reward_mean or 0.0 for r in records[:third]) / third
    late = sum(r.reward_mean or 0.0 for r in records[-third:]) / third
    assert late > early, (early, late)

    # The last step's update, trained again on one rank from the same base and batch, is the published one.
    replay, published = _replayed_on_one_rank(cluster, FINAL)
    pairs = zip(replay.lora_parameters, published, strict=True)
    gap = max((mine - theirs).abs().max().item() for mine, theirs in pairs)
    assert gap < UPDATE_TOLERANCE, gap


@pytest.mark.parametrize("victim", [0, 1], ids=["leader", "follower"])
def test_kill_9_of_one_rank_ends_the_worker_and_its_step_is_recovered_within_a_minute(
    make_cluster: Callable[..., LocalCluster], victim: int
) -> None:
    # Every version is kept, so all up to the step can be read back at the end while the run goes on (with
    # the default retention, versions older than max_staleness + 1 behind the current one were collected first).
    cluster = make_cluster(defaults=True, extra_toml="keep_every = 1\n")
    busy = cluster.start_worker("optimize", name="opt-1", nproc_per_node=2)
    cluster.start_worker("generate", name="gen-1")
    cluster.start_worker("generate", name="gen-2")
    wait_for(version_reached(cluster, 1), 240, "version 1", cluster)
    standby = cluster.start_worker("optimize", name="opt-2")
    wait_for(
        lambda: _alive(cluster, "opt-2"),
        120,
        "the stand-by trainer's heartbeat",
        cluster,
    )
    ranks = _rank_processes(busy)
    assert sorted(ranks) == [0, 1], ranks
    # Only the proxy's re-send may hand the step over, as for a single-device worker.
    os.kill(standby.pid, signal.SIGSTOP)
    try:
        task = wait_for(working_on(cluster, "opt-1"), 120, "a step sent to opt-1", cluster)
        cluster.expect_dead(busy)
        ranks[victim].kill()  # kill -9 of one rank, mid-step or between steps
        killed = time.monotonic()
    finally:
        os.kill(standby.pid, signal.SIGCONT)
    # No rank waits on a collective with a dead peer: the launcher and the leader exit within seconds.
    wait_for(lambda: not busy.alive(), 45, "opt-1's launcher to exit", cluster)
    assert busy.popen.returncode != 0
    for process in ranks.values():
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    step = int(task.split("-")[1])
    wait_for(version_reached(cluster, step), 60, f"step {step} published after the rank died", cluster)
    assert time.monotonic() - killed < 60
    records = records_of(cluster)
    assert_run_invariants(records)
    # Nothing half-written was published: every version up to the step reads back against the proxy's sha.
    bucket = open_env_bucket(cluster.bucket_url)
    client = ProxyClient(cluster.proxy_url, cluster.token)
    for version in range(step + 1):  # all kept (keep_every = 1): the run goes on while they are read
        manifest_key = bucket_keys.manifest_key(cluster.run, version)
        read_verified(bucket, manifest_key, client.version_info(version).manifest_sha256)
