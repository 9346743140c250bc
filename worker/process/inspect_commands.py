"""Custom ``celery inspect`` commands of asyncgrpo workers.

    celery -A worker.process.inspect_commands inspect adapter_versions
    celery -A worker.process.inspect_commands inspect model_info

Importing this module registers the commands, in the worker (which answers them) and in the ``celery``
command line (which refuses command names it does not know): hence ``-A worker.process.inspect_commands``, which
also finds the Celery ``app`` re-exported here. They read the worker's process runtime
(``worker.process.runtime.get_runtime``) for the role in ``ASYNCGRPO_WORKER_ROLE`` (set by ``asyncgrpo worker``).
A solo-pool worker answers only between tasks; the proxy's ``GET /v1/workers`` (heartbeats) is the view
that also covers busy workers.
"""

from __future__ import annotations

from typing import Any

import torch
from celery.worker.control import inspect_command

from worker.process.celery_app import app
from worker.process.launcher import ROLE_ENV
from worker.process.runtime import WorkerRuntime, get_runtime
from worker.process.settings import process_settings

__all__ = ("adapter_versions", "app", "model_info")  # a tuple: nothing here is module state to change


def _role() -> str:
    role = process_settings().worker_role  # a value that is not a role raises, naming the variable
    if role is None:
        raise ValueError(f"{ROLE_ENV} is not set; start workers with `asyncgrpo worker generate|optimize`")
    return role


def adapter_versions_of(runtime: WorkerRuntime) -> dict[str, Any]:
    """The adapter versions this process holds: cached per run (generate) and the trainer's (optimize)."""
    return {
        "role": runtime.role,
        "worker_id": runtime.settings.worker_id,
        "versions_cached": runtime.versions_cached(),
        "versions_by_run": {run: cache.versions() for run, cache in sorted(runtime.adapter_caches.items())},
        "adapters_loaded": _loaded_adapters(runtime.backend),
        "trainer_version": getattr(runtime.trainer, "version", None) if runtime.trainer is not None else None,
        "current_task": runtime.current_task,
    }


def _loaded_adapters(backend: Any) -> list[str]:
    """Adapter names the generation backend serves now (``v42``...), when it says."""
    loaded = getattr(backend, "loaded_adapters", None)
    return list(loaded()) if callable(loaded) else []


def _device_of(holder: Any) -> str | None:
    """The torch device of a backend or trainer: its own ``device`` or its policy's."""
    if holder is None:
        return None
    device = getattr(holder, "device", None) or getattr(getattr(holder, "policy", None), "device", None)
    return str(device) if device is not None else None


def model_info_of(runtime: WorkerRuntime) -> dict[str, Any]:
    """Which model this process runs, where, and with which backend."""
    backend = runtime.backend
    trainer = runtime.trainer
    return {
        "role": runtime.role,
        "worker_id": runtime.settings.worker_id,
        "models_by_run": {run: context.config.model.base for run, context in sorted(runtime.runs.items())},
        "device_setting": runtime.settings.device,
        "device": _device_of(backend) or _device_of(trainer),
        "backend": type(backend).__name__ if backend is not None else None,
        "backend_setting": runtime.settings.generation_backend,
        "backend_run": runtime.backend_run,
        "trainer_run": runtime.trainer_run,
        "trainer_version": getattr(trainer, "version", None) if trainer is not None else None,
        "loaded": backend is not None or trainer is not None,
        "torch_threads": torch.get_num_threads(),
    }


def _answer(describe: Any) -> dict[str, Any]:
    try:
        role = _role()
    except ValueError as error:
        return {"error": str(error)}
    return describe(get_runtime(role))


@inspect_command()
def adapter_versions(state: Any) -> dict[str, Any]:
    """Adapter versions this worker holds (cached adapters, trainer version)."""
    return _answer(adapter_versions_of)


@inspect_command()
def model_info(state: Any) -> dict[str, Any]:
    """Model, device, backend and trainer version of this worker."""
    return _answer(model_info_of)
