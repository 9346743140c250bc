"""A step's versions in the bucket, as the optimize job reads them: pinned to the sha the proxy recorded.

Loading a base version into the trainer, finding an earlier attempt's complete upload of the same step (never
deleted: a version with a manifest is immutable), the record stored with a version, and whether the proxy
published our manifest. A corrupted object of a published version is reported to the proxy, which repairs it
from the memory of the trainer holding it or halts the run.

The exact bytes of the last version this trainer uploaded (or loaded), kept to repair the bucket.

A published version's object that the bucket corrupted is put back from here: the proxy sends a repair task
to the own queue of the worker holding the version, and ``repair_object`` re-puts the object under the same
key only if these bytes' sha256 equal the manifest's entry (versions stay immutable: same content, same
key). One version is held per process, replaced by the next upload or load.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectNotFound
from asyncgrpo.bucket.layout import (
    IntegrityError,
    Manifest,
    read_manifest,
    read_verified,
    read_version_files,
    sha256_hex,
)
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.errors import NotFound, ProxyError
from asyncgrpo.protocol.records import StepRecord
from asyncgrpo.protocol.schemas import RepairTaskMessage
from worker.optimize.trainer import Trainer


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


log = structlog.get_logger()


def load_trainer_version(
    trainer: Trainer, bucket: Bucket, run: str, version: int, client: ProxyClient, worker_id: str
) -> None:
    """Load version ``version`` (weights, optimizer moments, step, RNG) from the bucket, verified against the
    manifest sha the proxy recorded at publish; a corrupted object is reported to the proxy, then raised."""
    expected = client.version_info(version).manifest_sha256
    try:
        manifest, manifest_sha, files = read_version_files(
            bucket, run, version, expected, skip=(bucket_keys.STEP_RECORD_NAME,)
        )
    except IntegrityError as error:
        report_corrupt(client, version, worker_id, error)
        raise
    loaded = trainer.load_version_files(files)
    if loaded != version:
        key = bucket_keys.manifest_key(run, version)
        raise IntegrityError(f"trainer state of version {version} ({key}) says version {loaded}", key=key)
    hold(run, manifest, manifest_sha, files)


def report_corrupt(client: ProxyClient, version: int, worker_id: str, error: IntegrityError) -> None:
    """Tell the proxy about a corrupted object of a published version (it repairs it or halts the run)."""
    try:
        answer = client.report_corrupt(version, worker_id, error.key)
        log.warning("optimize.corrupt_reported", version=version, key=error.key, action=answer.action)
    except ProxyError as report_error:
        log.warning("optimize.corrupt_report_failed", version=version, key=error.key, error=str(report_error))


def uploaded_attempt(
    bucket: Bucket, run: str, step: int, rollout_ids: list[str], client: ProxyClient, worker_id: str
) -> str | None:
    """sha256 of a complete earlier upload of this very step (same base, same batch), if one exists.

    Never deletes it: a manifest is create-only and a version with one is immutable. One made from another
    batch is a conflict (``UploadConflict``), never adopted.
    """
    try:
        manifest, manifest_sha = read_manifest(bucket, run, step)
    except ObjectNotFound:
        return None
    meta = manifest.metadata
    if meta.get("base_version") != step - 1 or sorted(meta.get("rollouts", [])) != sorted(rollout_ids):
        raise UploadConflict(f"version {step} was uploaded from another batch ({bucket_keys.manifest_key(run, step)})")
    try:
        for name, entry in manifest.files.items():
            read_verified(bucket, manifest.file_key(run, name), entry.sha256)
    except IntegrityError as error:
        if client.run_info().current_version >= step:
            report_corrupt(client, step, worker_id, error)
        raise
    return manifest_sha


class UploadConflict(Exception):
    """Another attempt's manifest for this version exists and is not ours to publish."""


def stored_step_record(bucket: Bucket, run: str, step: int) -> StepRecord | None:
    """The record in a version's files (an earlier attempt's upload); the task's result reports it."""
    manifest, _ = read_manifest(bucket, run, step)
    entry = manifest.files.get(bucket_keys.STEP_RECORD_NAME)
    if entry is None:
        return None
    data = read_verified(bucket, manifest.file_key(run, bucket_keys.STEP_RECORD_NAME), entry.sha256)
    return StepRecord.model_validate_json(data)


def same_bytes(manifest: Manifest, files: dict[str, bytes]) -> bool:
    """True if ``files`` are exactly what ``manifest`` lists (a stored manifest may be another attempt's)."""
    return set(files) == set(manifest.files) and all(
        sha256_hex(data) == manifest.files[name].sha256 for name, data in files.items()
    )


def published_is_ours(step: int, manifest_sha: str, client: ProxyClient) -> bool:
    """True if the proxy recorded our manifest as version ``step`` (the sha it published, not the bucket's)."""
    try:
        return client.version_info(step).manifest_sha256 == manifest_sha
    except NotFound:
        return False
