"""End-to-end, every shipped timeout (``make_cluster(defaults=True)``): versions that cannot tear, and a
corrupted current adapter repaired from the memory of the trainer that holds it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import httpx
import pytest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import ObjectNotFound
from asyncgrpo.bucket.layout import read_manifest, read_version_files
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.schemas import OptimizeTaskMessage
from asyncgrpo.run.creation import load_run
from cli.local_cluster import LocalCluster
from tests.support.e2e_harness import records_of, version_reached, wait_for
from tests.support.fixtures_s3 import open_env_bucket
from worker.model.policy import Policy
from worker.optimize.job import Optimizer
from worker.optimize.trainer import Trainer

pytestmark = pytest.mark.slow


def _published_versions_verify(cluster: LocalCluster) -> None:
    """Every published version still in the bucket reads back intact against the sha the proxy recorded,
    and every trained step has its metrics record."""
    bucket = open_env_bucket(cluster.bucket_url)
    client = ProxyClient(cluster.proxy_url, cluster.token)
    current = cluster.status()["current_version"]
    for version in range(current + 1):
        manifest_key = bucket_keys.manifest_key(cluster.run, version)
        if bucket.head(manifest_key) is None:
            continue  # collected by retention
        try:
            read_version_files(bucket, cluster.run, version, client.version_info(version).manifest_sha256)
        except ObjectNotFound:
            # The run goes on, so retention may collect this version while it is read. It deletes the manifest
            # before the files: a file missing while the manifest is still there is a torn version.
            if bucket.head(manifest_key) is not None:
                raise
    # The run goes on meanwhile: records up to `current` at least, contiguous (a newer publish may add one).
    steps = [r.step for r in records_of(cluster)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= current, steps


def test_a_paused_attempt_cannot_tear_the_version_another_published(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(defaults=True)
    # The test hook makes the upload go one file at a time, so the zombie can be paused between two files.
    zombie = cluster.start_worker("optimize", name="opt-zombie", env={"ASYNCGRPO_UPLOAD_PAUSE_S": "0.5"})
    cluster.start_worker("generate", name="gen-1")
    wait_for(version_reached(cluster, 1), 240, "version 1", cluster)
    bucket = open_env_bucket(cluster.bucket_url)

    def first_file_of_next_step() -> int | None:
        step = cluster.status()["current_version"] + 1
        prefix = bucket_keys.adapter_prefix(cluster.run, step)
        keys = bucket.list(prefix)
        if keys and bucket_keys.manifest_key(cluster.run, step) not in keys:
            return step
        return None

    step = wait_for(first_file_of_next_step, 240, "the zombie's first file of a step", cluster)
    os.kill(zombie.pid, signal.SIGSTOP)
    try:
        # The re-sent step, run by another trainer (here in the test process, with the real job and bucket).
        client = ProxyClient(cluster.proxy_url, cluster.token)
        batch = client.get_step(step)
        config, _, _ = load_run(bucket, cluster.run)
        trainer = Trainer.initial(Policy.load(config.model.base, config.model.dtype, "cpu"), config)
        trainer.version = None
        message = OptimizeTaskMessage(
            run=cluster.run, step=step, base_version=batch.base_version, rollouts=batch.rollouts
        )
        result = Optimizer(cluster.run, config, trainer, bucket, client, "opt-other").run_task(message)
        assert result.status == "published"
        # Read while the zombie is paused: nothing else trains, so retention cannot collect the version yet.
        manifest, _ = read_manifest(bucket, cluster.run, step)
        assert manifest.metadata["worker_id"] == "opt-other"
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    # The zombie finishes its upload under its own attempt folder and loses the manifest: a conflict, not an
    # error; the run goes on and nothing it wrote is read.
    wait_for(version_reached(cluster, step + 1), 240, "a version after the contested one", cluster)
    # Every version still in the bucket, the contested one included, matches the sha the proxy recorded: the
    # zombie's late files replaced nothing.
    _published_versions_verify(cluster)
    log = (cluster.workdir / "logs" / "opt-zombie.log").read_text()
    assert "optimize.upload_lost" in log and "worker.task_failed" not in log


def test_a_corrupted_current_adapter_is_repaired_by_its_trainer_and_the_run_moves(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(defaults=True)
    cluster.start_worker("optimize", name="opt-1")
    wait_for(lambda: cluster.status()["current_version"] >= 0, 240, "version 0", cluster)
    bucket = open_env_bucket(cluster.bucket_url)
    manifest, _ = read_manifest(bucket, cluster.run, 0)
    key = manifest.file_key(cluster.run, bucket_keys.ADAPTER_WEIGHTS_NAME)
    bucket.put(key, b"other bytes")  # the bucket corrupts the current adapter; opt-1 holds it in memory

    cluster.start_worker("generate", name="gen-1")  # an empty cache: it must fetch the corrupted version
    workers = f"{cluster.proxy_url}/v1/workers"
    wait_for(
        lambda: any(
            w["worker_id"] == "gen-1"
            for w in httpx.get(workers, headers={"Authorization": f"Bearer {cluster.token}"}).json()["workers"]
        ),
        120,
        "gen-1 up",
        cluster,
    )
    started = time.monotonic()
    wait_for(version_reached(cluster, 1), 30, "a new version within 30 s of the corruption meeting a reader", cluster)
    assert time.monotonic() - started < 30
    _published_versions_verify(cluster)
    # It was put back from opt-1's memory (same key, same bytes), not rewritten under a new name.
    assert '"outcome": "repaired"' in (cluster.workdir / "logs" / "opt-1.log").read_text()
