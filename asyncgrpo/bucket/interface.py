"""The bucket interface: where every tensor and sample of a run lives (adapters, rollouts, config, prompts).

``Bucket`` is the few operations a run needs; its errors name the key. The backends are
``asyncgrpo.bucket.file_backend`` and ``asyncgrpo.bucket.s3_backend``; ``asyncgrpo.bucket.backends.open_bucket``
picks one from a URL. Keys are plain relative paths built by ``asyncgrpo.bucket.keys``; nothing here formats run keys.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

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
