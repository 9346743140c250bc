"""Adapter-version manifests: written last and create-only, verified on every read (invariant 5)."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, FileBucket, ObjectExists, ObjectNotFound
from asyncgrpo.bucket.layout import (
    IntegrityError,
    delete_version,
    fetch_version,
    latest_complete_version,
    list_versions,
    read_manifest,
    read_verified,
    sha256_hex,
    write_version,
)

RUN = "r1"


def _files(seed: int, size: int = 2048) -> dict[str, bytes]:
    rng = bytes((seed * 31 + i) % 251 for i in range(size))
    return {
        bucket_keys.ADAPTER_WEIGHTS_NAME: rng,
        bucket_keys.ADAPTER_CONFIG_NAME: json.dumps({"r": 8, "seed": seed}).encode(),
        bucket_keys.TRAINER_STATE_TENSORS_NAME: rng[::-1],
    }


def test_sha256_hex_is_the_standard_digest() -> None:
    assert sha256_hex(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_write_then_read_manifest(bucket: Bucket) -> None:
    files = _files(1)
    manifest, manifest_sha = write_version(bucket, RUN, 3, files, {"step": 3, "base_version": 2})
    stored, stored_sha = read_manifest(bucket, RUN, 3)
    assert stored == manifest and stored_sha == manifest_sha
    assert stored_sha == sha256_hex(bucket.get(bucket_keys.manifest_key(RUN, 3)))
    assert stored.version == 3 and stored.metadata == {"step": 3, "base_version": 2}
    assert {name: entry.sha256 for name, entry in stored.files.items()} == {
        name: sha256_hex(data) for name, data in files.items()
    }
    assert {name: entry.size for name, entry in stored.files.items()} == {n: len(d) for n, d in files.items()}
    with pytest.raises(ObjectNotFound, match=re.escape(bucket_keys.manifest_key(RUN, 4))):
        read_manifest(bucket, RUN, 4)


class _RecordingBucket(FileBucket):
    """A real FileBucket that also records the order of its writes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.writes: list[tuple[str, bool]] = []

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.writes.append((key, if_absent))
        super().put(key, data, if_absent=if_absent)


def test_manifest_is_written_last_and_create_only(tmp_path: Path) -> None:
    bucket = _RecordingBucket(tmp_path)
    manifest, _ = write_version(bucket, RUN, 0, _files(0), {})
    assert bucket.writes[-1] == (bucket_keys.manifest_key(RUN, 0), True)
    assert {key for key, _ in bucket.writes[:-1]} == {manifest.file_key(RUN, name) for name in _files(0)}
    # The files sit under this attempt's own folder, which the manifest names.
    assert manifest.attempt and all(f"/v00000000/{manifest.attempt}/" in key for key, _ in bucket.writes[:-1])


class _SlowWeightsBucket(FileBucket):
    """Stores the adapter weights slowly and records when each put finished."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.finished: list[str] = []
        self.lock = threading.Lock()

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if key.endswith(bucket_keys.ADAPTER_WEIGHTS_NAME):
            time.sleep(0.2)
        super().put(key, data, if_absent=if_absent)
        with self.lock:
            self.finished.append(key)


def test_files_travel_in_parallel_and_the_manifest_waits_for_the_slowest(tmp_path: Path) -> None:
    bucket = _SlowWeightsBucket(tmp_path)
    manifest, _ = write_version(bucket, RUN, 0, _files(0), {})
    weights = manifest.file_key(RUN, bucket_keys.ADAPTER_WEIGHTS_NAME)
    assert bucket.finished[-1] == bucket_keys.manifest_key(RUN, 0), "the manifest is stored after every file"
    assert bucket.finished[-2] == weights, "the other files did not wait for the slow one"


def test_a_generate_worker_fetches_only_the_adapter_files(bucket: Bucket, tmp_path: Path) -> None:
    _, sha = write_version(bucket, RUN, 0, _files(0), {})
    fetch_version(bucket, RUN, 0, tmp_path / "v0", expected_manifest_sha256=sha, names=bucket_keys.ADAPTER_FILE_NAMES)
    assert sorted(p.name for p in (tmp_path / "v0").iterdir()) == sorted(
        [*bucket_keys.ADAPTER_FILE_NAMES, bucket_keys.MANIFEST_NAME]
    )
    with pytest.raises(IntegrityError, match=re.escape("lists no ['optimizer.bin']")):
        fetch_version(bucket, RUN, 0, tmp_path / "other", names=["optimizer.bin"])
    assert not (tmp_path / "other").exists()


def test_redelivered_write_is_idempotent_and_other_files_are_refused(bucket: Bucket, tmp_path: Path) -> None:
    first, first_sha = write_version(bucket, RUN, 5, _files(5), {"worker": "a"})
    again, again_sha = write_version(bucket, RUN, 5, _files(5), {"worker": "b"})
    assert (again, again_sha) == (first, first_sha)  # the stored manifest, untouched
    with pytest.raises(ObjectExists, match="immutable"):
        write_version(bucket, RUN, 5, _files(6), {"worker": "zombie"})
    # The published version was not altered by the refused writer.
    fetched = fetch_version(bucket, RUN, 5, tmp_path / "v5", expected_manifest_sha256=first_sha)
    assert fetched == first


def test_corrupted_object_is_refused_and_nothing_is_left(bucket: Bucket, tmp_path: Path) -> None:
    files = _files(2)
    manifest, manifest_sha = write_version(bucket, RUN, 2, files, {})
    weights_key = manifest.file_key(RUN, bucket_keys.ADAPTER_WEIGHTS_NAME)
    corrupted = bytearray(files[bucket_keys.ADAPTER_WEIGHTS_NAME])
    corrupted[100] ^= 0xFF
    bucket.put(weights_key, bytes(corrupted))
    expected = manifest.files[bucket_keys.ADAPTER_WEIGHTS_NAME].sha256

    with pytest.raises(IntegrityError) as caught:
        read_verified(bucket, weights_key, expected)
    message = str(caught.value)
    assert weights_key in message and expected in message and sha256_hex(bytes(corrupted)) in message
    assert caught.value.key == weights_key

    cache = tmp_path / "cache"
    with pytest.raises(IntegrityError, match=re.escape(weights_key)):
        fetch_version(bucket, RUN, 2, cache / "v2", expected_manifest_sha256=manifest_sha)
    assert list(cache.iterdir()) == []  # neither the version nor a partial download


def test_manifest_checksum_from_the_lease_is_checked(bucket: Bucket, tmp_path: Path) -> None:
    write_version(bucket, RUN, 1, _files(1), {})
    wrong = "0" * 64
    with pytest.raises(IntegrityError, match=re.escape(bucket_keys.manifest_key(RUN, 1))):
        fetch_version(bucket, RUN, 1, tmp_path / "v1", expected_manifest_sha256=wrong)
    assert not (tmp_path / "v1").exists()


def test_malformed_manifest_is_an_integrity_error(bucket: Bucket) -> None:
    bucket.put(bucket_keys.manifest_key(RUN, 9), b'{"version": 9}')
    with pytest.raises(IntegrityError, match=re.escape(bucket_keys.manifest_key(RUN, 9))):
        read_manifest(bucket, RUN, 9)


def test_fetch_version_replaces_a_stale_copy(bucket: Bucket, tmp_path: Path) -> None:
    files = _files(4)
    _, manifest_sha = write_version(bucket, RUN, 4, files, {})
    dest = tmp_path / "cache" / "v4"
    dest.mkdir(parents=True)
    (dest / "leftover.bin").write_bytes(b"junk")
    fetch_version(bucket, RUN, 4, dest, expected_manifest_sha256=manifest_sha)
    assert sorted(p.name for p in dest.iterdir()) == sorted([*files, bucket_keys.MANIFEST_NAME])
    for name, data in files.items():
        assert (dest / name).read_bytes() == data
    fetch_version(bucket, RUN, 4, dest)  # again: the verified copy stays
    assert sorted(p.name for p in dest.parent.iterdir()) == ["v4"]  # no staging folder left


def test_latest_complete_version_ignores_versions_without_manifest(bucket: Bucket) -> None:
    assert latest_complete_version(bucket, RUN) is None
    write_version(bucket, RUN, 0, _files(0), {})
    write_version(bucket, RUN, 1, _files(1), {})
    # Version 2 is half uploaded: files, no manifest (a trainer killed mid-upload).
    bucket.put(bucket_keys.adapter_file_key(RUN, 2, bucket_keys.ADAPTER_WEIGHTS_NAME), b"partial")
    assert list_versions(bucket, RUN) == [0, 1, 2]
    assert latest_complete_version(bucket, RUN) == 1


def test_delete_version_removes_manifest_and_files(bucket: Bucket) -> None:
    write_version(bucket, RUN, 0, _files(0), {})
    write_version(bucket, RUN, 1, _files(1), {})
    delete_version(bucket, RUN, 1)
    assert bucket.list(bucket_keys.adapter_prefix(RUN, 1)) == []
    assert latest_complete_version(bucket, RUN) == 0
    assert len(bucket.list(bucket_keys.adapter_prefix(RUN, 0))) == 4
    delete_version(bucket, RUN, 1)  # idempotent


def test_reader_that_sees_the_manifest_sees_every_file(bucket: Bucket, tmp_path: Path) -> None:
    versions = 6
    failures: list[BaseException] = []
    done = threading.Event()

    def writer() -> None:
        try:
            for version in range(versions):
                write_version(bucket, RUN, version, _files(version, size=64 * 1024), {"step": version})
        except BaseException as error:  # surfaced in the assert below
            failures.append(error)
        finally:
            done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    seen: set[int] = set()
    while not done.is_set() or len(seen) < versions:
        latest = latest_complete_version(bucket, RUN)
        if latest is not None and latest not in seen:
            # Must succeed: the manifest is visible only once all its files are.
            fetch_version(bucket, RUN, latest, tmp_path / f"v{latest}")
            seen.add(latest)
        if done.is_set() and latest == versions - 1:
            break
    thread.join(timeout=60)
    assert failures == []
    assert versions - 1 in seen
    for version in seen:
        assert (tmp_path / f"v{version}" / bucket_keys.ADAPTER_WEIGHTS_NAME).read_bytes() == _files(
            version, size=64 * 1024
        )[bucket_keys.ADAPTER_WEIGHTS_NAME]
