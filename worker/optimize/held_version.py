"""The exact bytes of the last version this trainer uploaded (or loaded), kept to repair the bucket.

A published version's object that the bucket corrupted is put back from here: the proxy sends a repair task
to the own queue of the worker holding the version, and ``repair_object`` re-puts the object under the same
key only if these bytes' sha256 equal the manifest's entry (versions stay immutable: same content, same
key). One version is held per process, replaced by the next upload or load.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog

from asyncgrpo.bucket import keys as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.bucket.manifest import Manifest, read_verified, sha256_hex
from asyncgrpo.protocol.schemas import RepairTaskMessage

log = structlog.get_logger()


@dataclass(frozen=True)
class HeldVersion:
    run: str
    manifest: Manifest
    manifest_sha256: str
    files: dict[str, bytes]


_lock = threading.Lock()
_held: HeldVersion | None = None


def hold(run: str, manifest: Manifest, manifest_sha256: str, files: dict[str, bytes]) -> None:
    """Keep ``files`` (the bytes just uploaded or verified) as the held copy of ``manifest.version``."""
    global _held
    with _lock:
        _held = HeldVersion(run, manifest, manifest_sha256, dict(files))


def held_version() -> int | None:
    with _lock:
        return None if _held is None else _held.manifest.version


def repair_object(bucket: Bucket, message: RepairTaskMessage) -> str:
    """Put ``message.key`` back from the held bytes; returns what happened (a bounded word for the log)."""
    with _lock:
        held = _held
    if held is None or held.run != message.run or held.manifest.version != message.version:
        return "not_held"
    if held.manifest_sha256 != message.manifest_sha256:
        return "other_manifest"  # we hold a losing attempt's bytes: never put them under the published keys
    if message.key == bucket_keys.manifest_key(message.run, message.version):
        data = held.manifest.to_bytes()
        expected = message.manifest_sha256
    else:
        name = held.manifest.name_of_key(message.run, message.key)
        if name is None or name not in held.files:
            return "not_held"
        data, expected = held.files[name], held.manifest.files[name].sha256
    if sha256_hex(data) != expected:
        return "bytes_differ"
    bucket.put(message.key, data)
    read_verified(bucket, message.key, expected)  # it reads back intact, or the task fails loudly
    return "repaired"
