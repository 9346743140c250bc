"""The ``s3://`` backend: S3 or any S3-compatible store (``s3://bucket/prefix``).

The endpoint is given by the caller (``open_bucket`` takes it from ``ASYNCGRPO_S3_ENDPOINT_URL`` through
``asyncgrpo.protocol.settings.StorageSettings``); credentials and region follow the standard AWS chain.
Create-only writes send ``If-None-Match: *`` (412 -> ``ObjectExists``). AWS S3, SeaweedFS and moto honour it;
a store that ignores the header lets the last writer win, so there manifests are "write once" only by
convention (the version CAS at the proxy still fences publishers).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from asyncgrpo.bucket.backends import (
    Bucket,
    BucketError,
    InvalidBucketURL,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    check_key,
    check_prefix,
    temp_sibling,
)

log = structlog.get_logger()

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
        with self._translate(key, "get"):
            response = self.client.get_object(Bucket=self.bucket, Key=self._full(key))
            return response["Body"].read()

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

    def delete_prefix(self, prefix: str) -> int:
        check_prefix(prefix)
        keys = self.list(prefix)
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = keys[start : start + 1000]
            with self._translate(prefix, "delete_prefix"):
                response = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": self._full(key)} for key in batch], "Quiet": True},
                )
            errors = response.get("Errors", [])
            if errors:
                first = errors[0]
                raise BucketError(
                    f"deleting {len(errors)} keys under {prefix!r} failed, first {first.get('Key')!r}: "
                    f"{first.get('Code')} {first.get('Message')}"
                )
        return len(keys)

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
