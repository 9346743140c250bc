"""Where every object of a run lives in the bucket, and how a reader knows a version is complete and unaltered.

Every object key is built here, and nowhere else.

Layout of one run (``<run>`` is the run name)::

    runs/<run>/config.json                        the run config, written once at creation
    runs/<run>/RUN_MANIFEST.json                  sha256 of config.json and prompts.jsonl, written last
    runs/<run>/prompts/prompts.jsonl              the dataset as the run saw it
    runs/<run>/prompts/eval_prompts.jsonl         the held-out eval prompts (only with [eval])
    runs/<run>/adapters/v00000042/MANIFEST.json   the version: sha256 of each file and the attempt that
                                                  wrote them (create-only, written last)
    runs/<run>/adapters/v00000042/<attempt>/<file> adapter_model.safetensors, adapter_config.json,
                                                  trainer_state.safetensors, trainer_state.json, ...
    runs/<run>/rollouts/<task-id>.safetensors     one generate task's samples
    runs/<run>/partials/p00000042.json            an interrupted task's unfinished sequences of prompt 42,
                                                  which the next task of that prompt continues
    runs/<run>/metrics/step-00000042.json         one record per optimizer step
    runs/<run>/evals/v00000042.json               the evaluation of one version (only with [eval])
    runs/<run>/proxy/snapshot.json                what the proxy needs to rebuild Redis (compacted)
    runs/<run>/proxy/log/000000000042.json        what changed since; applied in order on a rebuild

Version directories are zero-padded so that a lexical listing is also a numeric one. Each attempt at a
version writes its files under a folder of its own (``<attempt>``), so two attempts never write one object:
the manifest that wins the create-only write names its attempt, and readers read only that attempt's files.
Manifests written before attempts existed name none (``""``): their files sit in the version folder itself.

Manifests. An adapter version ``runs/<run>/adapters/v00000042/`` is complete once its ``MANIFEST.json`` exists. Each
attempt at a version (a task, a redelivery of it, a zombie woken from a pause) uploads its files under an
attempt folder of its own, then writes the manifest last and create-only, naming its attempt: a reader that
sees the manifest reads only the files it names, which no other attempt ever writes (invariant 1). The
manifest holds the sha256 and size of each file; readers check each object against it before use and
refuse a mismatch with an ``IntegrityError`` naming the key (invariant 5).

A version is immutable: once its manifest exists, nothing but retention's collection of old versions
deletes or rewrites it. An attempt that loses the manifest write gets the stored manifest back if its files
are the same bytes (a redelivered task), ``ObjectExists`` otherwise; either way it removes its own attempt
folder, and the CAS at the proxy decides which manifest is published. A loser that dies first leaves its
folder to retention, which deletes a collected version's whole prefix.

The run manifest (``RUN_MANIFEST.json``) plays the same role for the run's config and prompts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from asyncgrpo.bucket.backends import Bucket, ObjectExists, ObjectNotFound
from asyncgrpo.protocol.schemas import ID_PATTERN, RUN_NAME, RUN_NAME_RULE

MANIFEST_NAME = "MANIFEST.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
TRAINER_STATE_TENSORS_NAME = "trainer_state.safetensors"
TRAINER_STATE_JSON_NAME = "trainer_state.json"
STEP_RECORD_NAME = "step_record.json"
"""The step's record, a file of its version; the proxy copies it to ``metrics/`` when it publishes."""
ADAPTER_FILE_NAMES = (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME)
"""The files of a version a generate worker needs (a plain PEFT adapter folder); the rest is the trainer's."""

_TASK_ID = re.compile(ID_PATTERN)
_VERSION_DIR = re.compile(r"/adapters/v(\d{8})/$")
_ATTEMPT = re.compile(r"^[a-z0-9]{1,32}$")
_EVAL_KEY = re.compile(r"/evals/v(\d{8})\.json$")
_LOG_KEY = re.compile(r"/proxy/log/(\d{12})\.json$")


class InvalidKeyPart(ValueError):
    """A run name or task id that cannot be part of a key."""


def check_run_name(run: str) -> str:
    if not RUN_NAME.fullmatch(run):  # fullmatch: "$" would let a trailing newline in
        raise InvalidKeyPart(f"run name {run!r} is not allowed: {RUN_NAME_RULE}")
    return run


def check_task_id(task_id: str) -> str:
    if not _TASK_ID.fullmatch(task_id):
        raise InvalidKeyPart(f"task id {task_id!r} is not allowed: use 1-128 letters, digits, '.', '_', ':' or '-'")
    return task_id


def adapter_name(version: int) -> str:
    """The name a generator serves a version under (``v42``); never reused for another policy."""
    return f"v{version}"


def run_prefix(run: str) -> str:
    return f"runs/{check_run_name(run)}/"


def config_key(run: str) -> str:
    return run_prefix(run) + "config.json"


def run_manifest_key(run: str) -> str:
    return run_prefix(run) + "RUN_MANIFEST.json"


def prompts_key(run: str) -> str:
    return run_prefix(run) + "prompts/prompts.jsonl"


def eval_prompts_key(run: str) -> str:
    return run_prefix(run) + "prompts/eval_prompts.jsonl"


def adapters_prefix(run: str) -> str:
    return run_prefix(run) + "adapters/"


def adapter_prefix(run: str, version: int) -> str:
    if version < 0:
        raise ValueError(f"adapter version must be >= 0, got {version}")
    return f"{adapters_prefix(run)}v{version:08d}/"


def check_attempt(attempt: str) -> str:
    if attempt and not _ATTEMPT.fullmatch(attempt):
        raise InvalidKeyPart(f"attempt id {attempt!r} is not allowed: use 1-32 lowercase letters or digits")
    return attempt


def attempt_prefix(run: str, version: int, attempt: str) -> str:
    """The folder one attempt at ``version`` writes its files under (the version folder for ``""``)."""
    return adapter_prefix(run, version) + (f"{check_attempt(attempt)}/" if attempt else "")


def adapter_file_key(run: str, version: int, filename: str, attempt: str = "") -> str:
    """The key of file ``filename`` of ``version`` as written by ``attempt`` (its manifest names the attempt)."""
    if "/" in filename or not filename:
        raise InvalidKeyPart(f"adapter file name {filename!r} must be a plain file name")
    return attempt_prefix(run, version, attempt) + filename


def manifest_key(run: str, version: int) -> str:
    return adapter_prefix(run, version) + MANIFEST_NAME


def version_from_adapter_prefix(prefix: str) -> int | None:
    """``runs/r/adapters/v00000042/`` -> 42; anything else -> None."""
    match = _VERSION_DIR.search(prefix)
    return int(match.group(1)) if match else None


def rollouts_prefix(run: str) -> str:
    return run_prefix(run) + "rollouts/"


def rollout_key(run: str, task_id: str) -> str:
    return f"{rollouts_prefix(run)}{check_task_id(task_id)}.safetensors"


def partials_prefix(run: str) -> str:
    return run_prefix(run) + "partials/"


def partial_key(run: str, prompt_index: int) -> str:
    """The partial sequences of prompt ``prompt_index`` an interrupted task saved (``worker.generate.partial``)."""
    if prompt_index < 0:
        raise ValueError(f"prompt index {prompt_index} must be >= 0")
    return f"{partials_prefix(run)}p{prompt_index:08d}.json"


def metrics_prefix(run: str) -> str:
    return run_prefix(run) + "metrics/"


def metrics_key(run: str, step: int) -> str:
    return f"{metrics_prefix(run)}step-{step:08d}.json"


def evals_prefix(run: str) -> str:
    return run_prefix(run) + "evals/"


def eval_key(run: str, version: int) -> str:
    if version < 0:
        raise ValueError(f"eval version must be >= 0, got {version}")
    return f"{evals_prefix(run)}v{version:08d}.json"


def version_from_eval_key(key: str) -> int | None:
    """``runs/r/evals/v00000042.json`` -> 42; anything else -> None."""
    match = _EVAL_KEY.search(key)
    return int(match.group(1)) if match else None


def proxy_snapshot_key(run: str) -> str:
    return run_prefix(run) + "proxy/snapshot.json"


def proxy_log_prefix(run: str) -> str:
    """The folder of the snapshot log's segments (``proxy.coordinator.snapshot_log``)."""
    return run_prefix(run) + "proxy/log/"


def proxy_log_key(run: str, seq: int) -> str:
    """One segment of the snapshot log, numbered so that a lexical listing is also a numeric one."""
    if not 0 < seq < 10**12:
        raise ValueError(f"log sequence number must be in 1..10**12-1, got {seq}")
    return f"{proxy_log_prefix(run)}{seq:012d}.json"


def seq_from_log_key(key: str) -> int | None:
    """``runs/r/proxy/log/000000000042.json`` -> 42; anything else -> None."""
    match = _LOG_KEY.search(key)
    return int(match.group(1)) if match else None


def proxy_probe_key(run: str, token: str) -> str:
    """A throwaway object the proxy writes and deletes at start-up to test the store's create-only writes."""
    if not token.isalnum():
        raise ValueError(f"probe token {token!r} must be alphanumeric")
    return run_prefix(run) + f"proxy/probe-{token}"


# ---- versions: files first, manifest last ----
_Item = TypeVar("_Item")

TRANSFER_THREADS = 8
"""Files of one version moved at once: object stores answer each request after a round trip, and a local
file's fsync waits on the disk; neither needs the GIL, so a version's files travel in parallel."""


def _each_in_parallel(action: Callable[[_Item], None], items: Iterable[_Item]) -> None:
    """``action`` on every item, several at a time; the first failure is raised once all have ended."""
    items = list(items)
    if len(items) < 2:
        for item in items:
            action(item)
        return
    with ThreadPoolExecutor(max_workers=min(TRANSFER_THREADS, len(items))) as pool:
        for future in [pool.submit(action, item) for item in items]:
            future.result()


log = structlog.get_logger()

MANIFEST_FORMAT = 1
_HASH_CHUNK = 1024 * 1024


class IntegrityError(Exception):
    """An object whose bytes do not match its manifest, or a manifest that cannot be read.

    The message names the key and, for a checksum mismatch, the expected and actual sha256. The object is
    never used.
    """

    def __init__(self, message: str, *, key: str, expected: str | None = None, actual: str | None = None):
        super().__init__(message)
        self.key = key
        self.expected = expected
        self.actual = actual


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _mismatch(key: str, expected: str, actual: str) -> IntegrityError:
    return IntegrityError(
        f"bucket object {key!r} failed its integrity check: expected sha256 {expected}, got {actual}; "
        "it was not used (the object was changed or corrupted after its manifest was written)",
        key=key,
        expected=expected,
        actual=actual,
    )


class ManifestEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Lowercase hex sha256 of the file's bytes.")
    size: int = Field(ge=0, description="Size of the file in bytes.")


class Manifest(BaseModel):
    """``MANIFEST.json`` of one adapter version: every file of the version with its sha256 and size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int = MANIFEST_FORMAT
    version: int = Field(ge=0)
    files: dict[str, ManifestEntry]
    created_at: float
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Written by the trainer: step, base_version, rollout task ids, worker."
    )
    attempt: str = Field(
        default="", description="The attempt whose files this manifest covers ('' for files in the version folder)."
    )

    def file_key(self, run: str, name: str) -> str:
        """The bucket key of file ``name`` of this version: the one object this manifest vouches for."""
        return adapter_file_key(run, self.version, name, self.attempt)

    def name_of_key(self, run: str, key: str) -> str | None:
        """The file name whose object is ``key``, or None if this manifest covers no such object."""
        return next((name for name in self.files if self.file_key(run, name) == key), None)

    @field_validator("files")
    @classmethod
    def _plain_names(cls, files: dict[str, ManifestEntry]) -> dict[str, ManifestEntry]:
        for name in files:
            if not name or "/" in name or name in (".", "..") or name == MANIFEST_NAME:
                raise ValueError(f"manifest file name {name!r} must be a plain file name other than MANIFEST.json")
        return files

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True).encode()


class FileDigest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class RunManifest(BaseModel):
    """``RUN_MANIFEST.json``: the run exists once this is written; it pins its config and prompts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: FileDigest
    prompts: FileDigest
    num_prompts: int = Field(ge=1)
    created_at: float
    eval_prompts: FileDigest | None = None
    """``prompts/eval_prompts.jsonl``, the held-out prompts of ``[eval]``; None for a run without evaluation."""
    num_eval_prompts: int = Field(0, ge=0)

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True).encode()


def _parse_manifest(key: str, data: bytes) -> Manifest:
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as error:
        raise IntegrityError(f"manifest {key!r} is not a valid manifest: {error}", key=key) from error


def new_attempt_id() -> str:
    """A fresh attempt folder name: unique per upload, so no two attempts ever write the same object."""
    return uuid.uuid4().hex[:16]


def write_version(
    bucket: Bucket,
    run: str,
    version: int,
    files: dict[str, bytes],
    metadata: dict[str, Any],
    attempt: str | None = None,
    between_files: Callable[[], None] | None = None,
) -> tuple[Manifest, str]:
    """Upload every file of ``version`` under a new attempt folder, then ``MANIFEST.json`` last, create-only.

    Returns ``(manifest, sha256 of the manifest's bytes)``. If the version already has a manifest with the
    same file contents, that stored manifest is returned (a redelivered task); with other files,
    ``ObjectExists``. ``between_files`` runs after each file's put (uploads then go one at a time): a test hook.
    """
    if not files:
        raise ValueError(f"version {version} of run {run!r} has no files; a version needs at least one")
    attempt = new_attempt_id() if attempt is None else check_attempt(attempt)
    manifest_object = manifest_key(run, version)
    entries = {name: ManifestEntry(sha256=sha256_hex(data), size=len(data)) for name, data in files.items()}
    manifest = Manifest(version=version, files=entries, created_at=time.time(), metadata=metadata, attempt=attempt)

    stored = _existing_manifest_matching(bucket, manifest_object, entries)
    if stored is not None:
        return stored

    # Every file before the manifest (written last, create-only): a reader never sees a manifest without them.
    def put(item: tuple[str, bytes]) -> None:
        bucket.put(manifest.file_key(run, item[0]), item[1])
        if between_files is not None:
            between_files()

    if between_files is None:
        _each_in_parallel(put, files.items())
    else:
        for item in files.items():
            put(item)
    payload = manifest.to_bytes()
    try:
        bucket.put(manifest_object, payload, if_absent=True)
    except ObjectExists:
        # Another attempt won: our folder is covered by no manifest, so nobody reads it; remove it.
        bucket.delete_prefix(attempt_prefix(run, version, attempt))
        stored = _existing_manifest_matching(bucket, manifest_object, entries)
        if stored is None:
            raise
        return stored
    log.info("manifest.version_written", run=run, version=version, attempt=attempt, files=sorted(files))
    return manifest, sha256_hex(payload)


def _existing_manifest_matching(
    bucket: Bucket, manifest_object: str, entries: dict[str, ManifestEntry]
) -> tuple[Manifest, str] | None:
    """The stored manifest if it lists exactly ``entries``; None if there is none; ObjectExists if it differs."""
    try:
        data = bucket.get(manifest_object)
    except ObjectNotFound:
        return None
    stored = _parse_manifest(manifest_object, data)
    if stored.files != entries:
        raise ObjectExists(
            f"{manifest_object!r} already exists with other files; version {stored.version} is immutable and "
            "was written by another trainer (this step lost the race; its result must be dropped)"
        )
    return stored, sha256_hex(data)


def read_manifest(bucket: Bucket, run: str, version: int) -> tuple[Manifest, str]:
    """The manifest of ``version`` and the sha256 of its bytes; ObjectNotFound if the version is incomplete."""
    key = manifest_key(run, version)
    data = bucket.get(key)
    manifest = _parse_manifest(key, data)
    if manifest.version != version:
        raise IntegrityError(f"manifest {key!r} describes version {manifest.version}, not {version}", key=key)
    return manifest, sha256_hex(data)


def read_verified(bucket: Bucket, key: str, expected_sha256: str) -> bytes:
    """The bytes of ``key`` if their sha256 is ``expected_sha256``; IntegrityError otherwise."""
    data = bucket.get(key)
    actual = sha256_hex(data)
    if actual != expected_sha256:
        raise _mismatch(key, expected_sha256, actual)
    return data


def read_version_files(
    bucket: Bucket,
    run: str,
    version: int,
    expected_manifest_sha256: str | None = None,
    skip: Collection[str] = (),
) -> tuple[Manifest, str, dict[str, bytes]]:
    """``(manifest, its sha256, {name: bytes})`` of ``version``, every file verified; ``skip`` names files
    not to read. With ``expected_manifest_sha256`` (what the proxy recorded at publish) a manifest whose
    bytes differ is an IntegrityError naming its key."""
    manifest, manifest_sha = read_manifest(bucket, run, version)
    if expected_manifest_sha256 is not None and manifest_sha != expected_manifest_sha256:
        raise _mismatch(manifest_key(run, version), expected_manifest_sha256, manifest_sha)
    files: dict[str, bytes] = {}

    def read(item: tuple[str, ManifestEntry]) -> None:
        files[item[0]] = read_verified(bucket, manifest.file_key(run, item[0]), item[1].sha256)

    _each_in_parallel(read, [item for item in manifest.files.items() if item[0] not in skip])
    return manifest, manifest_sha, files


def fetch_version(
    bucket: Bucket,
    run: str,
    version: int,
    dest_dir: Path,
    expected_manifest_sha256: str | None = None,
    names: Collection[str] | None = None,
) -> Manifest:
    """Download every file of ``version`` (or only ``names``) into ``dest_dir``, checked against the manifest.

    Files land in a temp folder next to ``dest_dir`` that is renamed into place only when every sha256
    matched, so ``dest_dir`` is either the whole verified version or untouched. ``MANIFEST.json`` is
    copied too. On a mismatch the IntegrityError names the key and nothing is left behind.
    """
    dest_dir = Path(dest_dir)
    manifest_object = manifest_key(run, version)
    manifest_bytes = bucket.get(manifest_object)
    manifest_sha = sha256_hex(manifest_bytes)
    if expected_manifest_sha256 is not None and manifest_sha != expected_manifest_sha256:
        raise _mismatch(manifest_object, expected_manifest_sha256, manifest_sha)
    manifest = _parse_manifest(manifest_object, manifest_bytes)
    if manifest.version != version:
        raise IntegrityError(
            f"manifest {manifest_object!r} describes version {manifest.version}, not {version}", key=manifest_object
        )

    absent = sorted(set(names or ()) - set(manifest.files))
    if absent:
        raise IntegrityError(
            f"manifest {manifest_object!r} lists no {absent}; the version is not a complete adapter",
            key=manifest_object,
        )

    dest_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = dest_dir.with_name(f".{dest_dir.name}.partial-{uuid.uuid4().hex}")
    staging.mkdir()

    wanted = manifest.files if names is None else {name: manifest.files[name] for name in names}

    def download(item: tuple[str, ManifestEntry]) -> None:
        name, entry = item
        key = manifest.file_key(run, name)
        target = staging / name
        bucket.get_file(key, target)
        actual = sha256_file(target)
        if actual != entry.sha256:
            raise _mismatch(key, entry.sha256, actual)

    try:
        _each_in_parallel(download, wanted.items())
        (staging / MANIFEST_NAME).write_bytes(manifest_bytes)
        _move_into_place(staging, dest_dir, manifest_bytes)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _move_into_place(staging: Path, dest_dir: Path, manifest_bytes: bytes) -> None:
    """Rename the verified staging folder to ``dest_dir``, replacing an older or partial copy there."""
    if dest_dir.exists():
        existing = dest_dir / MANIFEST_NAME
        with contextlib.suppress(OSError):
            if existing.read_bytes() == manifest_bytes:
                return  # another fetch of the same version got there first; its files were verified too
        aside = dest_dir.with_name(f".{dest_dir.name}.stale-{uuid.uuid4().hex}")
        os.rename(dest_dir, aside)
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(staging, dest_dir)
    except OSError:
        # A concurrent fetch renamed its own copy in between; keep it if it is this same version.
        existing = dest_dir / MANIFEST_NAME
        if not (existing.is_file() and existing.read_bytes() == manifest_bytes):
            raise


def list_versions(bucket: Bucket, run: str) -> list[int]:
    """Every version folder of the run (complete or not), ascending."""
    versions = (version_from_adapter_prefix(p) for p in bucket.list_dirs(adapters_prefix(run)))
    return sorted(v for v in versions if v is not None)


def latest_complete_version(bucket: Bucket, run: str) -> int | None:
    """The highest version that has a ``MANIFEST.json``; None if there is none."""
    for version in reversed(list_versions(bucket, run)):
        if bucket.head(manifest_key(run, version)) is not None:
            return version
    return None


def delete_version(bucket: Bucket, run: str, version: int) -> None:
    """Delete the manifest first (the version stops being complete at once), then its files."""
    bucket.delete(manifest_key(run, version))
    bucket.delete_prefix(adapter_prefix(run, version))
    log.info("manifest.version_deleted", run=run, version=version)
