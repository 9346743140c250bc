"""``asyncgrpo export``: one published version as a plain PEFT adapter folder, optionally merged.

The adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` exactly as the trainer
published them, each checked against the version's ``MANIFEST.json`` before it is written (a mismatch names
the key and nothing is written). That folder loads with ``PeftModel.from_pretrained(base, folder)`` and
serves as a vLLM ``LoRARequest``.

With ``merge``, the adapter is also folded into the run's base model (``merge_and_unload``) and written with
its tokenizer to ``<out>/merged``: a standalone model for ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectNotFound
from asyncgrpo.bucket.layout import latest_complete_version, read_manifest, read_verified, sha256_hex
from asyncgrpo.run.config import RunConfig
from asyncgrpo.run.creation import load_run

log = structlog.get_logger()

ADAPTER_FILES = (bucket_keys.ADAPTER_CONFIG_NAME, bucket_keys.ADAPTER_WEIGHTS_NAME)
MERGED_DIR_NAME = "merged"
EXPORT_INFO_NAME = "asyncgrpo_export.json"


class ExportError(ValueError):
    """A version that cannot be exported, or an output folder that cannot take it; says what to change."""


@dataclass(frozen=True)
class ExportResult:
    run: str
    version: int
    adapter_dir: Path
    merged_dir: Path | None
    sha256: dict[str, str]

    def summary(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "version": self.version,
            "adapter_dir": str(self.adapter_dir),
            "merged_dir": str(self.merged_dir) if self.merged_dir else None,
            "sha256": self.sha256,
        }


def resolve_version(bucket: Bucket, run: str, version: int | str) -> int:
    """An explicit version number, or 'latest' -> the highest complete version in the bucket."""
    if isinstance(version, str):
        if version != "latest":
            try:
                return int(version)
            except ValueError:
                raise ExportError(f"version {version!r} is neither a number nor 'latest'") from None
        latest = latest_complete_version(bucket, run)
        if latest is None:
            raise ExportError(f"run {run!r} has no complete version in {bucket!r} yet")
        return latest
    return version


def _prepare_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"output folder {out_dir} exists and is not empty; choose a new or empty folder")
    out_dir.mkdir(parents=True, exist_ok=True)


def read_adapter_files(bucket: Bucket, run: str, version: int) -> dict[str, bytes]:
    """The adapter's files of ``version``, each checked against the manifest (IntegrityError on mismatch)."""
    try:
        manifest, _ = read_manifest(bucket, run, version)
    except ObjectNotFound:
        raise ExportError(
            f"version {version} of run {run!r} is not in {bucket!r} (never published, or garbage-collected; "
            "versions kept for export are the latest and every async.keep_every-th)"
        ) from None
    files = {}
    for name in ADAPTER_FILES:
        entry = manifest.files.get(name)
        if entry is None:
            raise ExportError(f"version {version} of run {run!r} has no {name} in its manifest")
        files[name] = read_verified(bucket, manifest.file_key(run, name), entry.sha256)  # the attempt it names
    return files


def export_version(
    bucket: Bucket,
    run: str,
    version: int | str,
    out_dir: Path,
    *,
    merge: bool = False,
    device: str | None = "cpu",
    cache_dir: Path | None = None,
) -> ExportResult:
    """Write version ``version`` of ``run`` to ``out_dir`` as a PEFT adapter (and ``out_dir/merged``); a 'tiny'
    base is built in ``cache_dir``."""
    out_dir = Path(out_dir)
    number = resolve_version(bucket, run, version)
    files = read_adapter_files(bucket, run, number)
    config = load_run(bucket, run)[0] if merge else None  # verified against the run manifest
    _prepare_out_dir(out_dir)
    for name, data in files.items():
        (out_dir / name).write_bytes(data)
    sha256 = {name: sha256_hex(data) for name, data in files.items()}  # equal to the manifest's: verified
    info = {"run": run, "version": number, "adapter_name": bucket_keys.adapter_name(number), "sha256": sha256}
    (out_dir / EXPORT_INFO_NAME).write_text(json.dumps(info, indent=2, sort_keys=True))
    merged_dir = None
    if config is not None:
        merged_dir = merge_adapter(out_dir, config, out_dir / MERGED_DIR_NAME, device=device, cache_dir=cache_dir)
    log.info("tools.version_exported", run=run, version=number, out=str(out_dir), merged=merged_dir is not None)
    return ExportResult(run=run, version=number, adapter_dir=out_dir, merged_dir=merged_dir, sha256=sha256)


def merge_adapter(
    adapter_dir: Path,
    config: RunConfig,
    merged_dir: Path,
    *,
    device: str | None = "cpu",
    cache_dir: Path | None = None,
) -> Path:
    """Fold the adapter in ``adapter_dir`` into the run's base model and save it with its tokenizer."""
    from peft import PeftModel

    from worker.model.policy import Policy

    policy = Policy.load(config.model.base, dtype=config.model.dtype, device=device, cache_dir=cache_dir)
    model = PeftModel.from_pretrained(policy.model, str(adapter_dir))
    merged = model.merge_and_unload()
    # Written beside the final folder and renamed into place, so a crash leaves no half-saved model.
    staging = Path(tempfile.mkdtemp(prefix=f".{merged_dir.name}-", dir=merged_dir.parent))
    try:
        merged.save_pretrained(staging)
        policy.tokenizer.save_pretrained(staging)
        staging.rename(merged_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return merged_dir
