"""What a worker process builds once and keeps: bucket, proxy client, the run's config and prompts, the
model (a generation backend or a trainer), the adapter cache, the heartbeat and, on generate workers, the
adapter prefetcher with the lock it shares with the generate task.

Built lazily on the first task (so ``celery inspect`` and start-up stay fast), or, on a generate worker with
the prefetcher on, by the prefetcher's thread when it sees the first published version; kept for the life
of the process: the base model is loaded once, only adapters change between tasks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.run.config import RunConfig
from asyncgrpo.run.creation import load_eval_prompts, load_run
from worker.generate.adapters import AdapterCache, AdapterPrefetcher
from worker.process.heartbeat import Heartbeat
from worker.process.settings import WorkerSettings, process_settings

if TYPE_CHECKING:  # the backends and the trainer pull in torch; the runtime builds them lazily
    from worker.generate.backend import GenerationBackend
    from worker.optimize.trainer import Trainer

log = structlog.get_logger()


@dataclass
class RunContext:
    run: str
    config: RunConfig
    prompts: list[dict[str, Any]]
    eval_prompts: list[dict[str, Any]] = field(default_factory=list)
    """The held-out prompts of ``[eval]`` (empty without evaluation)."""


@dataclass
class WorkerRuntime:
    role: str
    settings: WorkerSettings
    bucket: Bucket
    client: ProxyClient
    runs: dict[str, RunContext] = field(default_factory=dict)
    backend: GenerationBackend | None = None  # on generate workers
    backend_run: str | None = None
    adapter_caches: dict[str, AdapterCache] = field(default_factory=dict)
    trainer: Trainer | None = None  # on optimize workers
    trainer_run: str | None = None
    current_task: str | None = None
    heartbeat: Heartbeat | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Held by a generate task while it builds or uses the backend and by the prefetcher while it loads a
    # version: backends (vLLM's engine above all) are not thread-safe.
    adapter_lock: threading.RLock = field(default_factory=threading.RLock)
    prefetcher: AdapterPrefetcher | None = None

    def run_context(self, run: str) -> RunContext:
        context = self.runs.get(run)
        if context is None:
            config, prompts, manifest = load_run(self.bucket, run)
            eval_prompts = load_eval_prompts(self.bucket, run, manifest)
            context = RunContext(run=run, config=config, prompts=prompts, eval_prompts=eval_prompts)
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
        if self.prefetcher is not None:
            info["prefetched_version"] = self.prefetcher.loaded_version
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

    def backend_and_cache(self, run: str) -> tuple[AdapterCache, Any]:
        """The adapter cache and backend of ``run``, built on first use; the caller holds ``adapter_lock``."""
        context = self.run_context(run)
        return self.adapter_cache(context), self.generation_backend(context)

    # -- optimize side -------------------------------------------------------------------------------
    def run_trainer(self, context: RunContext) -> Any:
        if self.trainer is None or self.trainer_run != context.run:
            from worker.model.policy import Policy
            from worker.optimize.trainer import Trainer

            config = context.config
            policy = Policy.load(config.model.base, config.model.dtype, self.settings.device, self.settings.cache)
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
        settings = process_settings()
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


def start_prefetcher(role: str) -> None:
    """On a generate worker with ``ASYNCGRPO_PREFETCH_ADAPTERS`` on, load new versions as they are published."""
    runtime = get_runtime(role)
    settings = runtime.settings
    if role != "generate" or not settings.prefetch_adapters or runtime.prefetcher is not None:
        return
    # Its own client: a long poll must not share retries or a connection with the task's calls.
    client = ProxyClient(settings.proxy_url, settings.token_value(), retries=0)
    runtime.prefetcher = AdapterPrefetcher(
        client,
        runtime.bucket,
        settings.cache / "adapters" / settings.worker_id / ".prefetch",
        runtime.backend_and_cache,
        runtime.adapter_lock,
        wait_s=settings.prefetch_wait_s,
    )
    runtime.prefetcher.start()
    log.info("worker.prefetch_started", wait_s=settings.prefetch_wait_s)
