"""The bucket: one interface, two backends, and ``open_bucket`` to pick one from a URL.

- ``FileBucket`` (``asyncgrpo.bucket.file_backend``): a local folder, ``file:///abs/path``; atomic, create-only
  writes by ``os.link``.
- ``S3Bucket`` (``asyncgrpo.bucket.s3_backend``): S3 or an S3-compatible store, ``s3://bucket/prefix``;
  create-only writes by ``If-None-Match: *``, multipart for large files.

Everything callers need is importable from here (``Bucket``, ``open_bucket``, the errors, both backends), so
they need not know which module holds what.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from asyncgrpo.bucket.file_backend import FileBucket
from asyncgrpo.bucket.interface import (
    Bucket,
    BucketError,
    InvalidBucketURL,
    InvalidKey,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    check_key,
)
from asyncgrpo.bucket.s3_backend import DEFAULT_MULTIPART_THRESHOLD, S3Bucket, make_s3_client

__all__ = [
    "DEFAULT_MULTIPART_THRESHOLD",
    "Bucket",
    "BucketError",
    "FileBucket",
    "InvalidBucketURL",
    "InvalidKey",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "S3Bucket",
    "check_key",
    "make_s3_client",
    "open_bucket",
]


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
