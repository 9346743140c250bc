"""The bucket contract on every backend: a local folder, real SeaweedFS, and moto."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncgrpo.bucket.backends import (
    Bucket,
    BucketError,
    FileBucket,
    InvalidBucketURL,
    InvalidKey,
    ObjectChanged,
    ObjectExists,
    ObjectNotFound,
    S3Bucket,
    open_bucket,
)


def test_put_get_head_roundtrip(bucket: Bucket) -> None:
    bucket.put("runs/r/config.json", b'{"a": 1}')
    assert bucket.get("runs/r/config.json") == b'{"a": 1}'
    info = bucket.head("runs/r/config.json")
    assert info is not None and info.key == "runs/r/config.json" and info.size == 8
    bucket.put("runs/r/config.json", b"{}")  # a plain put overwrites
    assert bucket.get("runs/r/config.json") == b"{}"
    assert bucket.head("runs/r/missing.json") is None


def test_missing_key_error_names_the_key(bucket: Bucket, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound, match=re.escape("runs/r/nope.json")):
        bucket.get("runs/r/nope.json")
    with pytest.raises(ObjectNotFound, match=re.escape("runs/r/nope.json")):
        bucket.get_file("runs/r/nope.json", tmp_path / "out" / "nope.json")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_list_and_list_dirs_are_sorted_and_scoped(bucket: Bucket) -> None:
    keys = [
        "runs/r/adapters/v00000002/MANIFEST.json",
        "runs/r/adapters/v00000000/adapter_model.safetensors",
        "runs/r/adapters/v00000001/adapter_model.safetensors",
        "runs/r/rollouts/t1.safetensors",
        "runs/r2/config.json",
    ]
    for key in keys:
        bucket.put(key, key.encode())
    assert bucket.list("runs/r/") == sorted(keys[:4])
    assert bucket.list("runs/r/adapters/v0000000") == sorted(keys[:3])
    assert bucket.list("runs/nothing/") == []
    assert bucket.list_dirs("runs/r/adapters/") == [
        "runs/r/adapters/v00000000/",
        "runs/r/adapters/v00000001/",
        "runs/r/adapters/v00000002/",
    ]
    assert bucket.list_dirs("runs/") == ["runs/r/", "runs/r2/"]
    assert bucket.list_dirs("runs/r/rollouts/") == []


def test_delete_is_idempotent_and_delete_prefix_counts(bucket: Bucket) -> None:
    for version in range(3):
        bucket.put(f"runs/r/adapters/v{version:08d}/a", b"x")
        bucket.put(f"runs/r/adapters/v{version:08d}/b", b"y")
    bucket.delete("runs/r/adapters/v00000000/a")
    bucket.delete("runs/r/adapters/v00000000/a")  # again: no error
    assert bucket.list("runs/r/adapters/v00000000/") == ["runs/r/adapters/v00000000/b"]
    assert bucket.delete_prefix("runs/r/adapters/v00000001/") == 2
    assert bucket.list_dirs("runs/r/adapters/") == ["runs/r/adapters/v00000000/", "runs/r/adapters/v00000002/"]
    assert bucket.delete_prefix("runs/r/adapters/") == 3
    assert bucket.list("runs/") == []
    with pytest.raises(InvalidKey, match="non-empty prefix"):
        bucket.delete_prefix("")


def test_put_file_get_file_roundtrip(bucket: Bucket, tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(300_000))
    bucket.put_file("runs/r/blob.bin", source)
    target = tmp_path / "deep" / "target.bin"
    bucket.get_file("runs/r/blob.bin", target)
    assert target.read_bytes() == source.read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["target.bin"]  # no temp file left behind
    with pytest.raises(ObjectExists, match=re.escape("runs/r/blob.bin")):
        bucket.put_file("runs/r/blob.bin", source, if_absent=True)
    with pytest.raises(FileNotFoundError, match="no such file"):
        bucket.put_file("runs/r/other.bin", tmp_path / "missing.bin")
    assert bucket.list("runs/r/") == ["runs/r/blob.bin"]


def test_create_only_write_keeps_the_first(bucket: Bucket) -> None:
    bucket.put("runs/r/adapters/v00000000/MANIFEST.json", b"first", if_absent=True)
    with pytest.raises(ObjectExists, match=re.escape("MANIFEST.json")):
        bucket.put("runs/r/adapters/v00000000/MANIFEST.json", b"second", if_absent=True)
    assert bucket.get("runs/r/adapters/v00000000/MANIFEST.json") == b"first"


def test_compare_and_swap_puts_only_over_the_etag_last_seen(bucket: Bucket) -> None:
    key = "runs/r/proxy/snapshot.json"
    first = bucket.put_if_match(key, b"one", None)
    with pytest.raises(ObjectChanged, match=re.escape(key)):
        bucket.put_if_match(key, b"created twice", None)
    data, etag = bucket.get_tagged(key)
    assert (data, etag) == (b"one", first)
    second = bucket.put_if_match(key, b"two", first)
    assert second != first and bucket.get_tagged(key) == (b"two", second)
    with pytest.raises(ObjectChanged, match=re.escape(key)):
        bucket.put_if_match(key, b"over a stale read", first)
    bucket.put(key, b"someone else")  # an unconditional writer moves the ETag too
    with pytest.raises(ObjectChanged):
        bucket.put_if_match(key, b"three", second)
    bucket.delete(key)
    with pytest.raises(ObjectChanged):
        bucket.put_if_match(key, b"over a deleted object", second)
    with pytest.raises(ObjectNotFound):
        bucket.get_tagged(key)


def test_racing_swappers_of_one_etag_exactly_one_wins(bucket: Bucket) -> None:
    key = "runs/r/proxy/snapshot.json"
    etag = bucket.put_if_match(key, b"base", None)
    writers = 6
    barrier = threading.Barrier(writers)
    outcomes: list[str] = []

    def swap(index: int) -> None:
        barrier.wait()
        try:
            bucket.put_if_match(key, f"writer-{index}".encode(), etag)
            outcomes.append(f"won-{index}")
        except ObjectChanged:
            outcomes.append("lost")

    threads = [threading.Thread(target=swap, args=(index,)) for index in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    winners = [outcome for outcome in outcomes if outcome != "lost"]
    assert len(outcomes) == writers and len(winners) == 1, outcomes
    assert bucket.get(key) == f"writer-{winners[0].removeprefix('won-')}".encode()


def test_racing_create_only_writers_exactly_one_wins(bucket: Bucket) -> None:
    key = "runs/r/adapters/v00000007/MANIFEST.json"
    # A store that ignores If-None-Match lets a second sequential write through: detect and skip.
    bucket.put("runs/r/probe", b"1", if_absent=True)
    try:
        bucket.put("runs/r/probe", b"2", if_absent=True)
    except ObjectExists:
        pass
    else:
        pytest.skip(f"{bucket.url} ignores If-None-Match; create-only writes are not enforced on this store")

    writers = 8
    barrier = threading.Barrier(writers)
    winners: list[int] = []
    losers: list[int] = []
    failures: list[BaseException] = []

    def write(index: int) -> None:
        barrier.wait()
        try:
            bucket.put(key, f"writer-{index}".encode(), if_absent=True)
            winners.append(index)
        except ObjectExists:
            losers.append(index)
        except BaseException as error:  # surfaced in the assert below
            failures.append(error)

    threads = [threading.Thread(target=write, args=(index,)) for index in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    assert len(winners) == 1, f"winners: {winners}"
    assert len(losers) == writers - 1
    assert bucket.get(key) == f"writer-{winners[0]}".encode()


@pytest.mark.parametrize(
    "key",
    ["", "/abs", "a/../b", "a//b", "a/./b", "a/", "a\\b", "runs/.asyncgrpo-tmp-x"],
)
def test_bad_keys_are_refused(bucket: Bucket, key: str) -> None:
    with pytest.raises(InvalidKey, match="not allowed"):
        bucket.put(key, b"x")


def test_multipart_upload_above_threshold(s3_bucket_factory: Callable[..., S3Bucket], tmp_path: Path) -> None:
    threshold = 5 * 1024 * 1024
    bucket = s3_bucket_factory(multipart_threshold=threshold)
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(2 * threshold + 12345))
    bucket.put_file("runs/r/big.bin", source)
    info = bucket.head("runs/r/big.bin")
    assert info is not None and info.size == source.stat().st_size
    # S3 etags of multipart objects are "<md5 of part md5s>-<number of parts>".
    assert info.etag is not None and info.etag.endswith("-3"), info.etag
    target = tmp_path / "back.bin"
    bucket.get_file("runs/r/big.bin", target)
    assert target.read_bytes() == source.read_bytes()

    # The create-only multipart path (done by hand: the transfer manager cannot send If-None-Match).
    bucket.put_file("runs/r/big-once.bin", source, if_absent=True)
    once = bucket.head("runs/r/big-once.bin")
    assert once is not None and once.etag is not None and once.etag.endswith("-3"), once
    with pytest.raises(ObjectExists, match=re.escape("big-once.bin")):
        bucket.put_file("runs/r/big-once.bin", source, if_absent=True)
    assert bucket.get("runs/r/big-once.bin") == source.read_bytes()


def test_open_bucket_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absolute = open_bucket(f"file://{tmp_path}/b")
    assert isinstance(absolute, FileBucket) and absolute.root == tmp_path / "b"
    monkeypatch.chdir(tmp_path)
    relative = open_bucket("file://rel/dir")
    assert isinstance(relative, FileBucket) and relative.root == tmp_path / "rel" / "dir"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3 = open_bucket("s3://my-bucket/some/prefix", s3_endpoint_url="http://127.0.0.1:1")
    assert isinstance(s3, S3Bucket)
    assert (s3.bucket, s3.prefix, s3.endpoint_url) == ("my-bucket", "some/prefix/", "http://127.0.0.1:1")
    with pytest.raises(InvalidBucketURL, match="s3://BUCKET/PREFIX"):
        open_bucket("gs://elsewhere/x")
    with pytest.raises(InvalidBucketURL, match="file:///absolute/path"):
        open_bucket("/plain/path")


def test_unreachable_s3_error_names_the_key() -> None:
    import boto3
    from botocore.config import Config

    client = boto3.session.Session(aws_access_key_id="x", aws_secret_access_key="y", region_name="us-east-1").client(
        "s3",
        endpoint_url="http://127.0.0.1:9",  # the discard port: nothing listens
        config=Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=2),
    )
    bucket = S3Bucket("b", "p", client=client)
    with pytest.raises(BucketError, match=re.escape("runs/r/config.json")):
        bucket.get("runs/r/config.json")


def test_file_bucket_key_under_an_object_is_a_clear_error(tmp_path: Path) -> None:
    bucket = FileBucket(tmp_path)
    bucket.put("a", b"x")
    with pytest.raises(BucketError, match="'a/b'"):
        bucket.put("a/b", b"y")


def test_file_bucket_makes_a_folder_again_that_a_concurrent_delete_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete prunes the folders it empties; a put into such a folder at that moment sees mkdir's "exists"
    and then no folder (the race the snapshot log's segments met: a compaction's collection against the next
    segment). It makes the folder again and stores the object, where an object in the way stays an error."""
    bucket = FileBucket(tmp_path)
    real_mkdir = Path.mkdir
    raced: list[Path] = []

    def pruned_meanwhile(self: Path, *args: object, **kwargs: object) -> None:
        if not raced:
            raced.append(self)
            raise FileExistsError(17, "File exists", str(self))
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", pruned_meanwhile)
    bucket.put("runs/r/proxy/log/000000000122.json", b"segment")
    assert raced and bucket.get("runs/r/proxy/log/000000000122.json") == b"segment"
    raced.clear()
    etag = bucket.put_if_match("runs/r/proxy/snapshot.json", b"s1", None)
    assert raced and bucket.get_tagged("runs/r/proxy/snapshot.json") == (b"s1", etag)
    monkeypatch.setattr(Path, "mkdir", real_mkdir)
    bucket.put("runs/r/file", b"x")
    with pytest.raises(BucketError, match="already a stored object"):
        bucket.put("runs/r/file/below", b"y")
