"""The bucket: where every tensor and sample of a run lives (adapters, rollouts, config, prompts).

- ``Bucket``: the few operations a run needs; its errors name the key. Keys are plain relative paths built by
  ``asyncgrpo.bucket.layout``; nothing here formats run keys.
- ``FileBucket``: a local folder, ``file:///abs/path``, the embedded default for one machine. Writes are atomic
  (temp file in the same folder, then ``os.replace``); create-only writes use ``os.link``, which fails if the
  name exists, so of two racing writers exactly one wins.
- ``S3Bucket``: S3 or any S3-compatible store, ``s3://bucket/prefix``. The endpoint is given by the caller
  (``open_bucket`` takes it from ``ASYNCGRPO_S3_ENDPOINT_URL`` through ``asyncgrpo.protocol.settings``);
  credentials and region follow the standard AWS chain. Create-only writes send ``If-None-Match: *`` (412 ->
  ``ObjectExists``). AWS S3, SeaweedFS and moto honour it; a store that ignores the header lets the last writer
  win, so there manifests are "write once" only by convention (the version CAS at the proxy still fences
  publishers). Multipart for large files; boto3 is imported only when an S3 client is made.
- Compare-and-swap (``get_tagged`` and ``put_if_match``): a writer that must never overwrite what another wrote
  since its last read (the proxy's snapshot) puts with ``If-Match`` on the ETag it last saw (``If-None-Match: *``
  where it saw none); ``ObjectChanged`` otherwise. A folder computes the ETag as S3 does for a single put (the
  MD5 of the bytes) and swaps under an exclusive lock on the key's folder.
- ``open_bucket(url)`` picks one from a URL.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

import structlog

log = structlog.get_logger()

# Files being written carry this name prefix until they are renamed into place; listings skip them.
TEMP_PREFIX = ".asyncgrpo-tmp-"


class BucketError(Exception):
    """Base of every bucket failure; the message names the key."""


class ObjectNotFound(BucketError):
    """The key does not exist."""


class ObjectExists(BucketError):
    """A create-only write found the key already there."""


class ObjectChanged(BucketError):
    """A compare-and-swap put found the object changed (or created, or deleted) since the caller's ETag."""


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
    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """The bytes under ``key`` and their ETag (for ``put_if_match``); ObjectNotFound if there are none."""

    @abstractmethod
    def put_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        """Store ``data`` under ``key`` only if the object there still has ``etag`` (None: only if there is no
        object); returns the new ETag. Raises ``ObjectChanged`` and stores nothing otherwise."""

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
        self.delete_keys(keys)
        return len(keys)

    def delete_keys(self, keys: list[str]) -> None:
        """Remove each of ``keys`` (missing ones are not an error)."""
        for key in keys:
            self.delete(key)

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


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def temp_sibling(path: Path) -> Path:
    return path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex}-{path.name}")


# ---- the file:// backend ----

_COPY_CHUNK = 1024 * 1024
_MKDIR_ATTEMPTS = 3
"""A key's folders are made again this often when a concurrent delete prunes them meanwhile."""


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
        for attempt in range(_MKDIR_ATTEMPTS):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                return
            except (FileExistsError, NotADirectoryError) as error:
                # Either a stored object stands where a folder must be, or a concurrent delete pruned a folder
                # between mkdir's "exists" and its check that it is a folder: then make it again.
                if self._object_above(path) or attempt == _MKDIR_ATTEMPTS - 1:
                    raise BucketError(
                        f"cannot store bucket key {key!r}: a part of its path is already a stored object"
                    ) from error

    def _object_above(self, path: Path) -> bool:
        """Whether a file (a stored object) stands where one of ``path``'s folders goes."""
        folder = path.parent
        while folder != self.root:
            if folder.exists() and not folder.is_dir():
                return True
            folder = folder.parent
        return False

    def _write_atomically(self, key: str, fill: Callable[[IO[bytes]], Any], *, if_absent: bool) -> None:
        path = self._path(key)
        if path.is_dir():
            raise BucketError(f"cannot store bucket key {key!r}: it is a folder of other keys")
        # A concurrent delete may prune the freshly made (empty) parent folder; make it again then.
        for attempt in range(_MKDIR_ATTEMPTS):
            self._make_parent(path, key)
            temp = temp_sibling(path)
            try:
                handle = open(temp, "xb")  # noqa: SIM115 - closed by the with below, before the rename
            except FileNotFoundError:
                if attempt == _MKDIR_ATTEMPTS - 1:
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

    def _open_folder(self, path: Path, key: str) -> int:
        """The descriptor of ``path``'s folder, made first (again, if a concurrent delete pruned it meanwhile)."""
        for attempt in range(_MKDIR_ATTEMPTS):
            self._make_parent(path, key)
            try:
                return os.open(path.parent, os.O_RDONLY)
            except FileNotFoundError:
                if attempt == _MKDIR_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

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

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        data = self.get(key)  # os.replace swaps whole files: these bytes are one version of the object
        return data, _md5(data)

    def put_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        path = self._path(key)
        # Every swapper of a key locks its folder, so the compare and the rename are one step for them.
        folder = self._open_folder(path, key)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
            try:
                current: str | None = _md5(path.read_bytes())
            except FileNotFoundError:
                current = None
            if current != etag:
                raise ObjectChanged(
                    f"bucket key {key!r} changed since it was read (ETag {current}, expected {etag}); not overwritten"
                )
            self._write_atomically(key, lambda handle: handle.write(data), if_absent=etag is None)
        finally:
            os.close(folder)  # releases the lock
        return _md5(data)

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


# ---- the s3:// backend ----


DEFAULT_MULTIPART_THRESHOLD = 64 * 1024 * 1024
_MIN_PART_SIZE = 5 * 1024 * 1024  # S3's lower bound for every part but the last

_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_EXISTS_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict"}


def _error_code(error: Exception) -> str:
    response = getattr(error, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def make_s3_client(
    endpoint_url: str | None = None,
    *,
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str | None = None,
) -> Any:
    """A boto3 S3 client set up for S3 and S3-compatible stores.

    Credentials and region default to the standard AWS chain (env, profile, instance role).
    """
    import boto3
    from botocore.config import Config

    config = Config(
        # S3-compatible stores often reject the newer default CRC checksums.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"max_attempts": 5, "mode": "standard"},
        # Custom endpoints rarely have wildcard DNS for virtual-hosted bucket names.
        s3={"addressing_style": "path"} if endpoint_url else {},
        max_pool_connections=32,
    )
    session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key, region_name=region)
    return session.client("s3", endpoint_url=endpoint_url, config=config)


class S3Bucket(Bucket):
    """A bucket on S3 or an S3-compatible store; every key is stored as ``<prefix><key>``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        client: Any = None,
        *,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
    ) -> None:
        from boto3.s3.transfer import TransferConfig

        if not bucket:
            raise InvalidBucketURL("S3 bucket name is empty; use s3://BUCKET/PREFIX")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url or None
        self.url = f"s3://{bucket}/{self.prefix}"
        self.client = client if client is not None else make_s3_client(self.endpoint_url)
        self.multipart_threshold = multipart_threshold
        self.part_size = max(_MIN_PART_SIZE, multipart_threshold // 4)
        self.transfer_config = TransferConfig(
            multipart_threshold=multipart_threshold, multipart_chunksize=self.part_size
        )

    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _strip(self, full_key: str) -> str:
        return full_key[len(self.prefix) :]

    @contextlib.contextmanager
    def _translate(self, key: str, action: str) -> Iterator[None]:
        """Turn botocore failures into bucket errors that name the key."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as error:
            code = _error_code(error)
            if code in _NOT_FOUND_CODES:
                raise ObjectNotFound(f"bucket key {key!r} does not exist in {self.url}") from None
            if code in _EXISTS_CODES:
                raise ObjectExists(f"bucket key {key!r} already exists; create-only write refused") from None
            raise BucketError(f"{action} of bucket key {key!r} in {self.url} failed: {error}") from error
        except BotoCoreError as error:
            raise BucketError(f"{action} of bucket key {key!r} in {self.url} failed: {error}") from error

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        with self._translate(key, "put"):
            self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data, **extra)

    def get(self, key: str) -> bytes:
        return self.get_tagged(key)[0]

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        with self._translate(key, "get"):
            response = self.client.get_object(Bucket=self.bucket, Key=self._full(key))
            return response["Body"].read(), str(response["ETag"]).strip('"')

    def put_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": f'"{etag}"'}
        try:
            with self._translate(key, "put"):
                response = self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data, **condition)
        except (ObjectExists, ObjectNotFound):  # 412, 409 (a racing conditional put), or 404 (deleted since)
            raise ObjectChanged(
                f"bucket key {key!r} in {self.url} changed since it was read (expected ETag {etag}); not overwritten"
            ) from None
        return str(response["ETag"]).strip('"')

    def head(self, key: str) -> ObjectInfo | None:
        try:
            with self._translate(key, "head"):
                response = self.client.head_object(Bucket=self.bucket, Key=self._full(key))
        except ObjectNotFound:
            return None
        etag = response.get("ETag")
        return ObjectInfo(key=key, size=int(response["ContentLength"]), etag=etag.strip('"') if etag else None)

    def _pages(self, prefix: str, **extra: Any) -> Iterator[dict]:
        paginator = self.client.get_paginator("list_objects_v2")
        with self._translate(prefix, "list"):
            yield from paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix, **extra)

    def list(self, prefix: str) -> list[str]:
        keys = [self._strip(item["Key"]) for page in self._pages(prefix) for item in page.get("Contents", [])]
        # Some stores list "folder markers" (keys ending in '/'); they are not objects of ours.
        return sorted(key for key in keys if key and not key.endswith("/"))

    def list_dirs(self, prefix: str) -> list[str]:
        full_prefixes = [
            item["Prefix"] for page in self._pages(prefix, Delimiter="/") for item in page.get("CommonPrefixes", [])
        ]
        # Stores backed by a real file tree (SeaweedFS) may still report a folder whose objects were all
        # just deleted; S3 semantics say it is gone, so keep only folders that hold an object.
        return sorted(self._strip(full) for full in full_prefixes if self._holds_an_object(full))

    def _holds_an_object(self, full_prefix: str) -> bool:
        with self._translate(self._strip(full_prefix), "list"):
            response = self.client.list_objects_v2(Bucket=self.bucket, Prefix=full_prefix, MaxKeys=1)
        return bool(response.get("Contents"))

    def delete(self, key: str) -> None:
        with self._translate(key, "delete"):
            self.client.delete_object(Bucket=self.bucket, Key=self._full(key))

    def delete_keys(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = keys[start : start + 1000]
            with self._translate(batch[0], "delete_keys"):
                response = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": self._full(key)} for key in batch], "Quiet": True},
                )
            errors = response.get("Errors", [])
            if errors:
                first = errors[0]
                raise BucketError(
                    f"deleting {len(errors)} of {len(batch)} keys failed, first {first.get('Key')!r}: "
                    f"{first.get('Code')} {first.get('Message')}"
                )

    def put_file(self, key: str, path: Path, *, if_absent: bool = False) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cannot upload {path} to bucket key {key!r}: no such file")
        full_key = self._full(key)
        if if_absent and path.stat().st_size >= self.multipart_threshold:
            # The transfer manager cannot send If-None-Match, so create-only multipart is done by hand.
            self._multipart_if_absent(key, path)
            return
        with self._translate(key, "put_file"):
            if if_absent:
                with open(path, "rb") as handle:
                    self.client.put_object(Bucket=self.bucket, Key=full_key, Body=handle, IfNoneMatch="*")
            else:
                self.client.upload_file(str(path), self.bucket, full_key, Config=self.transfer_config)

    def _multipart_if_absent(self, key: str, path: Path) -> None:
        full_key = self._full(key)
        with self._translate(key, "put_file"):
            upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=full_key)["UploadId"]
        completed = False
        try:
            parts = []
            with open(path, "rb") as handle, self._translate(key, "put_file"):
                number = 1
                while chunk := handle.read(self.part_size):
                    response = self.client.upload_part(
                        Bucket=self.bucket, Key=full_key, UploadId=upload_id, PartNumber=number, Body=chunk
                    )
                    parts.append({"ETag": response["ETag"], "PartNumber": number})
                    number += 1
                self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    IfNoneMatch="*",
                )
                completed = True
        finally:
            if not completed:
                self._abort_upload(key, full_key, upload_id)

    def _abort_upload(self, key: str, full_key: str, upload_id: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full_key, UploadId=upload_id)
        except (ClientError, BotoCoreError) as error:
            # The store's lifecycle rules reap abandoned uploads; the original error matters more.
            log.warning("bucket.abort_multipart_failed", key=key, upload_id=upload_id, error=str(error))

    def get_file(self, key: str, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = temp_sibling(path)
        try:
            with self._translate(key, "get_file"):
                self.client.download_file(self.bucket, self._full(key), str(temp), Config=self.transfer_config)
            os.replace(temp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()


# ---- picking a backend ----


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
        return S3Bucket(parsed.netloc, parsed.path.lstrip("/"), endpoint_url=s3_endpoint_url)
    raise InvalidBucketURL(
        f"bucket URL {url!r} is not supported; use file:///absolute/path for a local folder or "
        "s3://BUCKET/PREFIX for S3 (set ASYNCGRPO_S3_ENDPOINT_URL for an S3-compatible store)"
    )
