"""Every object key in the bucket is built here, and nowhere else.

Layout of one run (``<run>`` is the run name)::

    runs/<run>/config.json                        the run config, written once at creation
    runs/<run>/RUN_MANIFEST.json                  sha256 of config.json and prompts.jsonl, written last
    runs/<run>/prompts/prompts.jsonl              the dataset as the run saw it
    runs/<run>/adapters/v00000042/<file>          adapter_model.safetensors, adapter_config.json,
                                                  trainer_state.safetensors, trainer_state.json,
                                                  MANIFEST.json (sha256 of each, written last)
    runs/<run>/rollouts/<task-id>.safetensors     one generate task's samples
    runs/<run>/metrics/step-00000042.json         one record per optimizer step
    runs/<run>/proxy/snapshot.json                what the proxy needs to rebuild Redis

Version directories are zero-padded so that a lexical listing is also a numeric one.
"""

from __future__ import annotations

import re

MANIFEST_NAME = "MANIFEST.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
TRAINER_STATE_TENSORS_NAME = "trainer_state.safetensors"
TRAINER_STATE_JSON_NAME = "trainer_state.json"
ADAPTER_FILE_NAMES = (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME)
"""The files of a version a generate worker needs (a plain PEFT adapter folder); the rest is the trainer's."""

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_VERSION_DIR = re.compile(r"/adapters/v(\d{8})/$")


class InvalidKeyPart(ValueError):
    """A run name or task id that cannot be part of a key."""


def check_run_name(run: str) -> str:
    if not _RUN_NAME.fullmatch(run):  # fullmatch: "$" would let a trailing newline in
        raise InvalidKeyPart(
            f"run name {run!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return run


def check_task_id(task_id: str) -> str:
    if not _TASK_ID.fullmatch(task_id):
        raise InvalidKeyPart(
            f"task id {task_id!r} is not allowed: use 1-128 letters, digits, '.', '_', ':' or '-'"
        )
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


def adapters_prefix(run: str) -> str:
    return run_prefix(run) + "adapters/"


def adapter_prefix(run: str, version: int) -> str:
    if version < 0:
        raise ValueError(f"adapter version must be >= 0, got {version}")
    return f"{adapters_prefix(run)}v{version:08d}/"


def adapter_file_key(run: str, version: int, filename: str) -> str:
    if "/" in filename or not filename:
        raise InvalidKeyPart(f"adapter file name {filename!r} must be a plain file name")
    return adapter_prefix(run, version) + filename


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


def metrics_prefix(run: str) -> str:
    return run_prefix(run) + "metrics/"


def metrics_key(run: str, step: int) -> str:
    return f"{metrics_prefix(run)}step-{step:08d}.json"


def proxy_snapshot_key(run: str) -> str:
    return run_prefix(run) + "proxy/snapshot.json"
