"""Versions that cannot tear: per-attempt files, the step record made durable by the publish, and repair of
a corrupted object from the memory of the worker that holds the version (or a halt until it is restored)."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import pytest
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectExists
from asyncgrpo.bucket.layout import read_manifest, read_verified, read_version_files, write_version
from asyncgrpo.protocol.schemas import CorruptReport, HeartbeatRequest, RepairTaskMessage
from proxy.coordinator.scripts import VersionNotFound
from proxy.coordinator.service import Coordinator
from proxy.coordinator.steps import halted_reason as halted
from tests.support.dispatcher import RecordingDispatcher
from tests.support.proxy_harness import (
    ManualClock,
    file_bucket,
    make_coordinator,
    publish_request,
    small_config,
    submission,
)
from worker.optimize.job import HeldVersion

RUN = "r1"


def _files(tag: str) -> dict[str, bytes]:
    return {
        bucket_keys.ADAPTER_CONFIG_NAME: json.dumps({"r": 1}).encode(),
        bucket_keys.ADAPTER_WEIGHTS_NAME: f"weights of {tag}".encode() * 64,
        bucket_keys.STEP_RECORD_NAME: json.dumps({"by": tag}).encode(),
    }


def test_two_concurrent_attempts_never_tear_a_version(bucket: Bucket) -> None:
    # The zombie writes its first file, pauses; the other attempt writes and wins the manifest; the zombie
    # resumes, writes the rest and loses the create-only write. No object of the winner was touched.
    first_file_landed, resume = threading.Event(), threading.Event()
    outcome: list[BaseException] = []

    def zombie() -> None:
        def pause() -> None:
            first_file_landed.set()
            resume.wait(30)

        try:
            write_version(bucket, RUN, 5, _files("zombie"), {"step": 5}, between_files=pause)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=zombie)
    thread.start()
    assert first_file_landed.wait(30)
    winner, winner_sha = write_version(bucket, RUN, 5, _files("winner"), {"step": 5})
    resume.set()
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], ObjectExists)

    manifest, sha, files = read_version_files(bucket, RUN, 5, winner_sha)  # every file verifies
    assert sha == winner_sha and files == _files("winner") and manifest == winner
    # The loser removed its own folder: only the winner's attempt and the manifest remain.
    keys = set(bucket.list(bucket_keys.adapter_prefix(RUN, 5)))
    assert keys == {bucket_keys.manifest_key(RUN, 5)} | {winner.file_key(RUN, name) for name in _files("winner")}


def _publish_with_record(coord: Coordinator, version: int, worker_id: str = "trainer-1") -> str:
    """Claimed step ``version`` uploaded (with a step record) and published; returns the manifest sha."""
    for _ in range(10):
        coord.tick()
        if coord.status().step_inflight == version:
            break
        for task in list(coord.dispatcher.generate):
            with contextlib.suppress(Exception):  # already submitted, or cancelled
                coord.submit(submission(coord, task, coord.current_version()))
    files = _files(f"v{version}")
    if version == 0:
        del files[bucket_keys.STEP_RECORD_NAME]
    _, sha = write_version(
        coord.bucket, RUN, version, files, {"step": version, "base_version": version - 1, "worker_id": worker_id}
    )
    assert coord.publish(publish_request(version, sha, worker_id)).current_version == version
    return sha


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def coord(redis_client: Redis, tmp_path: Path, clock: ManualClock) -> Coordinator:
    config = small_config(groups_per_task=2, groups_per_step=2, queue_maxsize=8, max_staleness=1)
    return make_coordinator(redis_client, file_bucket(tmp_path), config=config, clock=clock)


def test_the_publish_copies_the_step_record_and_records_the_sha(coord: Coordinator) -> None:
    _publish_with_record(coord, 0)
    sha = _publish_with_record(coord, 1)
    assert coord.version_info(1).manifest_sha256 == sha
    with pytest.raises(VersionNotFound):
        coord.version_info(7)
    # Before the publish answered, metrics/ held the published manifest's record, byte for byte.
    assert coord.bucket.get(bucket_keys.metrics_key(RUN, 1)) == _files("v1")[bucket_keys.STEP_RECORD_NAME]


def test_a_record_lost_between_cas_and_copy_is_repaired_at_the_next_tick(
    redis_client: Redis, coord: Coordinator, clock: ManualClock
) -> None:
    _publish_with_record(coord, 0)
    _publish_with_record(coord, 1)
    coord.bucket.delete(bucket_keys.metrics_key(RUN, 1))  # as if the proxy died right after the CAS
    restarted = make_coordinator(redis_client, coord.bucket, config=coord.config, clock=clock)
    restarted.tick()
    assert coord.bucket.get(bucket_keys.metrics_key(RUN, 1)) == _files("v1")[bucket_keys.STEP_RECORD_NAME]


def _corrupt_weights(coord: Coordinator, version: int) -> str:
    manifest, _ = read_manifest(coord.bucket, RUN, version)
    key = manifest.file_key(RUN, bucket_keys.ADAPTER_WEIGHTS_NAME)
    coord.bucket.put(key, b"other bytes")
    return key


def _heartbeat(coord: Coordinator, worker_id: str, **info: int) -> None:
    coord.heartbeat(
        HeartbeatRequest(worker_id=worker_id, role="optimize", hostname="h", pid=1, state="idle", info=info)
    )


def test_a_corrupted_object_is_repaired_from_the_holders_memory(coord: Coordinator) -> None:
    _publish_with_record(coord, 0)
    sha = _publish_with_record(coord, 1, worker_id="opt-a")
    manifest, _ = read_manifest(coord.bucket, RUN, 1)
    held = HeldVersion()
    held.hold(RUN, manifest, sha, _files("v1"))  # what opt-a keeps after its upload
    _heartbeat(coord, "opt-a")
    key = manifest.file_key(RUN, bucket_keys.ADAPTER_WEIGHTS_NAME)
    assert coord.report_corrupt(1, CorruptReport(worker_id="gen-1", key=key)).action == "intact"
    _corrupt_weights(coord, 1)

    answer = coord.report_corrupt(1, CorruptReport(worker_id="gen-1", key=key))
    assert (answer.action, answer.holder) == ("repair_sent", "opt-a")
    dispatcher = coord.dispatcher
    assert isinstance(dispatcher, RecordingDispatcher) and dispatcher.repairs[0][0] == "opt-a"
    # The holder's repair task: same key, same bytes (checked against the manifest's entry).
    outcome = held.repair(coord.bucket, RepairTaskMessage(**dispatcher.repairs[0][1]))
    assert outcome == "repaired"
    read_verified(coord.bucket, key, manifest.files[bucket_keys.ADAPTER_WEIGHTS_NAME].sha256)
    # Bytes that are not the manifest's are never put, not even under a matching key.
    held.hold(RUN, manifest, sha, _files("something else"))
    assert held.repair(coord.bucket, RepairTaskMessage(**dispatcher.repairs[0][1])) == "bytes_differ"


def test_with_no_alive_holder_the_run_halts_until_the_object_is_restored(
    coord: Coordinator, clock: ManualClock
) -> None:
    _publish_with_record(coord, 0)
    _publish_with_record(coord, 1, worker_id="opt-gone")  # opt-gone never heartbeats: not alive
    good = coord.bucket.get(read_manifest(coord.bucket, RUN, 1)[0].file_key(RUN, bucket_keys.ADAPTER_WEIGHTS_NAME))
    key = _corrupt_weights(coord, 1)
    assert coord.report_corrupt(1, CorruptReport(worker_id="gen-1", key=key)).action == "halted"
    reason = halted(coord.store)
    assert reason is not None and key in reason
    sent = len(coord.dispatcher.generate)
    clock.advance(1)
    coord.tick()
    assert len(coord.dispatcher.generate) == sent and coord.status().step_inflight is None  # nothing moves

    coord.bucket.put(key, good)  # an operator restores it
    clock.advance(27)
    coord.tick()
    assert halted(coord.store) is not None, "re-read every 30 s, not every tick"
    clock.advance(2)
    coord.tick()
    assert halted(coord.store) is None
