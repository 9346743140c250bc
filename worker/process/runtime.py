"""What a worker process builds once and keeps: bucket, proxy client, the run's config and prompts, the
model (a generation backend or a trainer), the adapter cache and the heartbeat.

Built lazily on the first task (so ``celery inspect`` and start-up stay fast) and kept for the life of the
process: the base model is loaded once, only adapters change between tasks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import structlog

from proxy.protocol.client import ProxyClient
from proxy.run.config import RunConfig
from proxy.run.store import load_run
from proxy.storage.bucket import Bucket, open_bucket
from worker.generate.adapter_cache import AdapterCache
from worker.process.heartbeat import Heartbeat
from worker.process.settings import WorkerSettings, load_worker_settings

log = structlog.get_logger()


@dataclass
class RunContext:
    run: str
    config: RunConfig
    prompts: list[dict[str, Any]]


@dataclass
class WorkerRuntime:
    role: str
    settings: WorkerSettings
    bucket: Bucket
    client: ProxyClient
    runs: dict[str, RunContext] = field(default_factory=dict)
    backend: Any = None  # GenerationBackend on generate workers
    backend_run: str | None = None
    adapter_caches: dict[str, AdapterCache] = field(default_factory=dict)
    trainer: Any = None  # Trainer on optimize workers
    trainer_run: str | None = None
    current_task: str | None = None
    heartbeat: Heartbeat | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run_context(self, run: str) -> RunContext:
        context = self.runs.get(run)
        if context is None:
            config, prompts, _ = load_run(self.bucket, run)
            context = RunContext(run=run, config=config, prompts=prompts)
            self.runs[run] = context
        return context

    def versions_cached(self) -> list[int]:
        return sorted({v for cache in self.adapter_caches.values() for v in cache.versions()})

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"device": self.settings.device}
        if self.trainer is not None:
            info["trainer_version"] = getattr(self.trainer, "version", None)
        if self.backend is not None:
            info["backend"] = type(self.backend).__name__
        return {
            "state": "busy" if self.current_task else "idle",
            "versions_cached": self.versions_cached(),
            "current_task": self.current_task,
            "info": info,
        }

    # -- generate side -------------------------------------------------------------------------------
    def generation_backend(self, context: RunContext) -> Any:
        if self.backend is None or self.backend_run != context.run:
            from worker.generate.factory import build_generation_backend

            self.backend = build_generation_backend(context.config, self.settings)
            self.backend_run = context.run
        return self.backend

    def adapter_cache(self, context: RunContext) -> AdapterCache:
        cache = self.adapter_caches.get(context.run)
        if cache is None:
            backend = self.generation_backend(context)
            cache = AdapterCache(
                self.bucket,
                context.run,
                self.settings.cache / "adapters" / self.settings.worker_id,
                capacity=context.config.async_.max_staleness + 2,
                on_evict=lambda version: backend.drop_adapter(f"v{version}"),
            )
            self.adapter_caches[context.run] = cache
        return cache

    # -- optimize side -------------------------------------------------------------------------------
    def run_trainer(self, context: RunContext) -> Any:
        if self.trainer is None or self.trainer_run != context.run:
            from worker.model.policy import Policy
            from worker.optimize.trainer import Trainer

            config = context.config
            policy = Policy.load(config.model.base, config.model.dtype, self.settings.device)
            self.trainer = Trainer.initial(policy, config)
            # Unknown until a version is loaded from the bucket or version 0 is made here: a fresh LoRA init
            # on this device need not equal the published version 0.
            self.trainer.version = None
            self.trainer_run = context.run
        return self.trainer


_runtime: WorkerRuntime | None = None


def get_runtime(role: str) -> WorkerRuntime:
    """The process-wide runtime, built on first use and kept."""
    global _runtime
    if _runtime is None:
        settings = load_worker_settings()
        _runtime = WorkerRuntime(
            role=role,
            settings=settings,
            bucket=open_bucket(settings.bucket, s3_endpoint_url=settings.s3_endpoint_url),
            client=ProxyClient(settings.proxy_url, settings.token_value()),
        )
        log.info("worker.runtime_ready", role=role, worker_id=settings.worker_id, proxy=settings.proxy_url)
    return _runtime


def start_heartbeat(role: str) -> None:
    runtime = get_runtime(role)
    if runtime.heartbeat is None:
        runtime.heartbeat = Heartbeat(
            runtime.client,
            runtime.settings.worker_id,
            role,
            runtime.settings.heartbeat_s,
            runtime.describe,
            metrics_port=runtime.settings.metrics_port,
        )
        runtime.heartbeat.start()
