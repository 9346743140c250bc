"""The bucket: where every tensor and sample of a run lives (adapters, rollouts, config, prompts).

- ``Bucket``: the few operations a run needs; its errors name the key. Keys are plain relative paths built by
  ``asyncgrpo.bucket.layout``; nothing here formats run keys.
- ``FileBucket``: a local folder, ``file:///abs/path``, the embedded default for one machine. Writes are atomic
  (temp file in the same folder, then ``os.replace``); create-only writes use ``os.link``, which fails if the
  name exists, so of two racing writers exactly one wins.
- ``S3Bucket`` (``asyncgrpo.bucket.s3_backend``, apart because it needs boto3): S3 or an S3-compatible store,
  ``s3://bucket/prefix``; create-only writes by ``If-None-Match: *``, multipart for large files.
- ``open_bucket(url)`` picks one from a URL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

# Files being written carry this name prefix until they are renamed into place; listings skip them.
TEMP_PREFIX = ".asyncgrpo-tmp-"


class BucketError(Exception):
    """Base of every bucket failure; the message names the key."""


class ObjectNotFound(BucketError):
    """The key does not exist."""


class ObjectExists(BucketError):
    """A create-only write found the key already there."""


class InvalidBucketURL(BucketError, ValueError):
    """A bucket URL that is neither file:// nor s3://."""


class InvalidKey(BucketError, ValueError):
    """A key that could escape the bucket or name a folder."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str | None


def check_key(key: str) -> str:
    """Refuse keys that are empty, absolute, contain '.'/'..' or empty segments, or end in '/'."""
    parts = key.split("/")
    if (
        not key
        or key.startswith("/")
        or "\\" in key
        or any(part in ("", ".", "..") for part in parts)
        or any(part.startswith(TEMP_PREFIX) for part in parts)
    ):
        raise InvalidKey(
            f"bucket key {key!r} is not allowed: use a relative path of non-empty segments, without "
            f"'.', '..', backslashes or segments starting with {TEMP_PREFIX!r}"
        )
    return key


class Bucket(ABC):
    """Object storage with the few operations a run needs. Every key is relative to the bucket's URL."""

    url: str

    @abstractmethod
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Store ``data`` under ``key``; with ``if_absent`` raise ObjectExists instead of overwriting."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The bytes under ``key``; ObjectNotFound if there are none."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size and etag of ``key``, or None if it does not exist."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every full key that starts with ``prefix``, sorted."""

    @abstractmethod
    def list_dirs(self, prefix: str) -> list[str]:
        """Immediate sub-folders under ``prefix`` (full keys ending in '/'), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error."""

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key under ``prefix``; return how many were removed."""
        check_prefix(prefix)
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)

    @abstractmethod
    def put_file(self, key: str, path: Path, *, if_absent: bool = False) -> None:
        """Store the file at ``path`` under ``key`` without reading it whole into memory."""

    @abstractmethod
    def get_file(self, key: str, path: Path) -> None:
        """Write ``key`` to ``path`` atomically (temp file + rename): ``path`` is whole or absent."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def check_prefix(prefix: str) -> None:
    if not prefix:
        raise InvalidKey("delete_prefix needs a non-empty prefix; refusing to empty the whole bucket")


def temp_sibling(path: Path) -> Path:
    return path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex}-{path.name}")


# ---- the file:// backend ----

_COPY_CHUNK = 1024 * 1024


def _publish_temp(temp: Path, final: Path, *, if_absent: bool, key: str) -> None:
    """Move a fully written temp file to its final name; create-only via link, which fails if it exists."""
    try:
        if if_absent:
            try:
                os.link(temp, final)
            except FileExistsError:
                raise ObjectExists(f"bucket key {key!r} already exists; create-only write refused") from None
        else:
            os.replace(temp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


class FileBucket(Bucket):
    """A bucket in a local folder: ``<root>/<key>``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _make_parent(self, path: Path, key: str) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as error:
            raise BucketError(
                f"cannot store bucket key {key!r}: a part of its path is already a stored object"
            ) from error

    def _write_atomically(self, key: str, fill: Callable[[IO[bytes]], Any], *, if_absent: bool) -> None:
        path = self._path(key)
        if path.is_dir():
            raise BucketError(f"cannot store bucket key {key!r}: it is a folder of other keys")
        # A concurrent delete may prune the freshly made (empty) parent folder; make it again then.
        for attempt in range(3):
            self._make_parent(path, key)
            temp = temp_sibling(path)
            try:
                handle = open(temp, "xb")  # noqa: SIM115 - closed by the with below, before the rename
            except FileNotFoundError:
                if attempt == 2:
                    raise
                continue
            try:
                with handle:
                    fill(handle)
                    handle.flush()
                    os.fsync(handle.fileno())
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    temp.unlink()
                raise
            _publish_temp(temp, path, if_absent=if_absent, key=key)
            return

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._write_atomically(key, lambda handle: handle.write(data), if_absent=if_absent)

    def put_file(self, key: str, path: Path, *, if_absent: bool = False) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"cannot upload {path} to bucket key {key!r}: no such file")

        def copy(handle: IO[bytes]) -> None:
            with open(path, "rb") as source:
                shutil.copyfileobj(source, handle, _COPY_CHUNK)

        self._write_atomically(key, copy, if_absent=if_absent)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"bucket key {key!r} does not exist in {self.url}") from None

    def get_file(self, key: str, path: Path) -> None:
        source = self._path(key)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = temp_sibling(path)
        try:
            shutil.copyfile(source, temp)
            os.replace(temp, path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            if not source.is_file():
                raise ObjectNotFound(f"bucket key {key!r} does not exist in {self.url}") from None
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            stat = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not path.is_file():
            return None
        return ObjectInfo(key=key, size=stat.st_size, etag=None)

    def _walk_files(self, start: Path) -> Iterator[str]:
        for folder, _dirs, files in os.walk(start):
            relative = Path(folder).relative_to(self.root).as_posix()
            for name in files:
                if not name.startswith(TEMP_PREFIX):
                    yield name if relative == "." else f"{relative}/{name}"

    def list(self, prefix: str) -> list[str]:
        # Walk only the deepest folder the prefix fully names, then filter by the whole prefix.
        folder = prefix.rpartition("/")[0]
        start = self.root / folder if folder else self.root
        if not start.is_dir():
            return []
        return sorted(key for key in self._walk_files(start) if key.startswith(prefix))

    def list_dirs(self, prefix: str) -> list[str]:
        folder, _, stem = prefix.rpartition("/")
        start = self.root / folder if folder else self.root
        if not start.is_dir():
            return []
        found = []
        for entry in os.scandir(start):
            # An empty folder (left by a racing delete) is no "sub-folder" on S3 either.
            if (
                entry.is_dir()
                and entry.name.startswith(stem)
                and next(self._walk_files(Path(entry.path)), None) is not None
            ):
                found.append(f"{folder}/{entry.name}/" if folder else f"{entry.name}/")
        return sorted(found)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return  # nothing stored under exactly this key
        # Prune now-empty folders so the tree does not fill with empty version directories.
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


def open_bucket(url: str, *, s3_endpoint_url: str | None = None) -> Bucket:
    """``file:///abs/path`` or ``file://rel/path`` -> FileBucket; ``s3://bucket/prefix`` -> S3Bucket.

    An S3 bucket's endpoint is ``s3_endpoint_url`` (None: AWS); the caller reads it from its process's settings
    (``ASYNCGRPO_S3_ENDPOINT_URL``).
    """
    parsed = urlparse(url)
    if parsed.scheme == "file":
        # file:///abs -> netloc "" and path "/abs"; file://rel/x -> netloc "rel" and path "/x".
        location = parsed.netloc + parsed.path
        if not location:
            raise InvalidBucketURL(f"bucket URL {url!r} names no folder; use file:///absolute/path")
        return FileBucket(Path(location))
    if parsed.scheme == "s3":
        from asyncgrpo.bucket.s3_backend import S3Bucket  # boto3 only where an s3:// bucket is opened

        return S3Bucket(parsed.netloc, parsed.path.lstrip("/"), endpoint_url=s3_endpoint_url)
    raise InvalidBucketURL(
        f"bucket URL {url!r} is not supported; use file:///absolute/path for a local folder or "
        "s3://BUCKET/PREFIX for S3 (set ASYNCGRPO_S3_ENDPOINT_URL for an S3-compatible store)"
    )
