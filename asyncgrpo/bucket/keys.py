"""Every object key in the bucket is built here, and nowhere else.

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
    runs/<run>/metrics/step-00000042.json         one record per optimizer step
    runs/<run>/evals/v00000042.json               the evaluation of one version (only with [eval])
    runs/<run>/proxy/snapshot.json                what the proxy needs to rebuild Redis

Version directories are zero-padded so that a lexical listing is also a numeric one. Each attempt at a
version writes its files under a folder of its own (``<attempt>``), so two attempts never write one object:
the manifest that wins the create-only write names its attempt, and readers read only that attempt's files.
Manifests written before attempts existed name none (``""``): their files sit in the version folder itself.
"""

from __future__ import annotations

import re

MANIFEST_NAME = "MANIFEST.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
TRAINER_STATE_TENSORS_NAME = "trainer_state.safetensors"
TRAINER_STATE_JSON_NAME = "trainer_state.json"
STEP_RECORD_NAME = "step_record.json"
"""The step's record, a file of its version; the proxy copies it to ``metrics/`` when it publishes."""
ADAPTER_FILE_NAMES = (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME)
"""The files of a version a generate worker needs (a plain PEFT adapter folder); the rest is the trainer's."""

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_VERSION_DIR = re.compile(r"/adapters/v(\d{8})/$")
_ATTEMPT = re.compile(r"^[a-z0-9]{1,32}$")
_EVAL_KEY = re.compile(r"/evals/v(\d{8})\.json$")


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


def proxy_probe_key(run: str, token: str) -> str:
    """A throwaway object the proxy writes and deletes at start-up to test the store's create-only writes."""
    if not token.isalnum():
        raise ValueError(f"probe token {token!r} must be alphanumeric")
    return run_prefix(run) + f"proxy/probe-{token}"
