"""What a worker process builds once and keeps, and the thread that keeps its adapters current.

The runtime (``WorkerRuntime``) holds the bucket, proxy client, the run's config and prompts, the model (a
generation backend or a trainer and its ``Optimizer``), the adapter cache, the heartbeat, the ranks, the
preemption state, the metrics endpoint, the math-verify helper (``MathVerifier``: its process starts with the
first ``math_verify`` score) and, on generate workers, the adapter prefetcher with the lock it shares with the
generate task. One per process, kept on the process's Celery app (``get_runtime``), not in a module
global. Built lazily on the first task (so ``celery inspect`` and start-up stay fast), or, on a generate worker
with the prefetcher on, by the prefetcher's thread when it sees the first published version; kept for the life
of the process: the base model is loaded once, only adapters change between tasks.

The prefetcher (``AdapterPrefetcher``): each new adapter version is loaded as soon as it is published, from a
background thread of a generate worker.

Without it a worker fetches and loads a version only when its next task leases it, and every task pays
that on its critical path. The prefetcher long-polls the proxy (``GET /v1/versions/latest``); on a new
version it downloads the files and checks them against the manifest (outside any lock, so a running task
keeps generating), then, holding the worker's backend lock (the one a generate task holds while it loads
and samples; backends are not thread-safe), puts the version in the ``AdapterCache`` and loads it into the
backend. A task that leases that version then finds it cached and loaded.

Capacity: the cache keeps ``max_staleness + 2`` versions and evicts the least recently used one; since a
task holds the lock for as long as it uses its adapter, a preload can never evict a version in use.

Failures (proxy unreachable, bucket errors, an object that fails its sha256) are logged and retried with
backoff; a version that fails ``max_attempts`` times is left to the task path, which refuses a corrupt
object as before. Nothing here can stop the worker or a task. The prefetcher belongs to the process, not
to the generate side: it builds the runtime's backend and cache for a run it has not seen (``prepare``).
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError, open_bucket
from asyncgrpo.bucket.layout import fetch_version
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.errors import ProxyError
from asyncgrpo.protocol.schemas import (
    LatestVersion,
)
from asyncgrpo.run.config import RunConfig
from asyncgrpo.run.creation import RunNotFound, load_eval_prompts, load_run
from worker.algo.math_scoring import MathVerifier
from worker.generate.adapter_cache import AdapterCache
from worker.generate.backend import GenerationBackend
from worker.generate.inflight import StagedVersion, VersionOffers
from worker.process.heartbeat import Heartbeat
from worker.process.metrics import MetricsEndpoint
from worker.process.preemption import Preemption
from worker.process.settings import RankSettings, WorkerSettings, process_settings

if TYPE_CHECKING:  # the trainer is built lazily, on optimize workers only; reward models on generate workers
    from worker.generate.agent import AgentRun
    from worker.model.reward_models import RewardModels
    from worker.optimize.job import Optimizer
    from worker.optimize.ranks import Ranks
    from worker.optimize.trainer import Trainer
    from worker.process.celery_app import WorkerApp

log = structlog.get_logger()


# ---- the runtime: what a worker process builds once and keeps ----


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
    reward_models: RewardModels | None = None  # on generate workers: the run's reward models, loaded once
    reward_models_run: str | None = None
    agent: AgentRun | None = None  # on generate workers of an [agent] run: its tool processes and tool schemas
    agent_run: str | None = None
    adapter_caches: dict[str, AdapterCache] = field(default_factory=dict)
    trainer: Trainer | None = None  # on optimize workers
    trainer_run: str | None = None
    optimizer: Optimizer | None = None  # on optimize workers: the trainer's steps, and what they keep between them
    ranks: Ranks | None = None  # on optimize workers: the ranks this process joined (once: a process group is one)
    idle_since: float | None = None  # when the last task ended (or the worker became ready), for the idle metric
    preemption: Preemption = field(default_factory=Preemption)  # SIGTERM: the running task goes back to its queue
    metrics: MetricsEndpoint = field(default_factory=MetricsEndpoint)  # the process's /metrics endpoint
    # The math_verify reward's helper process: started by its first score (nothing until then), closed at shutdown.
    math_verifier: MathVerifier = field(default_factory=MathVerifier)
    current_task: str | None = None
    heartbeat: Heartbeat | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Held by a generate task while it builds or uses the backend and by the prefetcher while it loads a
    # version: backends (vLLM's engine above all) are not thread-safe.
    adapter_lock: threading.RLock = field(default_factory=threading.RLock)
    prefetcher: AdapterPrefetcher | None = None
    # Versions the prefetcher verified, offered to a task that follows new versions while it samples.
    version_offers: VersionOffers = field(default_factory=VersionOffers)

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
            info["ranks"] = getattr(getattr(self.trainer, "ranks", None), "world", 1)
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

    def run_reward_models(self, context: RunContext) -> RewardModels:
        """The reward models of the run's ``[[rewards]]`` and ``[eval] rewards``, loaded on the worker's device at
        start (``load_reward_models_at_start``), or here by the first task of a run created after the worker
        started. Raises ``RewardModelError``, which stops the worker (``worker.process.tasks``)."""
        if self.reward_models is None or self.reward_models_run != context.run:
            from worker.model.reward_models import RewardModels

            config = context.config
            rewards = [*config.rewards, *config.eval.rewards]
            self.reward_models = RewardModels.load(rewards, self.settings.device, config.model.dtype)
            self.reward_models_run = context.run
        return self.reward_models

    def run_agent(self, context: RunContext) -> AgentRun | None:
        """The [agent] run's tool processes (started once: the first imports and describes the tools), after a
        check of the chat template; None for a run without [agent]. Raises ToolSetupError or AgentSetupError, which stop
        the worker (``worker.process.tasks``)."""
        config = context.config.agent
        if config is None:
            return None
        if self.agent is None or self.agent_run != context.run:
            from worker.generate.agent import AgentRun, tool_process_count

            if self.agent is not None:
                self.agent.close()
            tokenizer = self.generation_backend(context).tokenizer
            processes = tool_process_count(config, context.config.async_.groups_per_task)
            self.agent = AgentRun.start(config, tokenizer, processes)
            self.agent_run = context.run
        return self.agent

    def adapter_cache(self, context: RunContext) -> AdapterCache:
        cache = self.adapter_caches.get(context.run)
        if cache is None:
            backend = self.generation_backend(context)
            cache = AdapterCache(
                self.bucket,
                context.run,
                self.settings.cache / "adapters" / self.settings.worker_id,
                capacity=context.config.async_.max_staleness + 2,
                backend=backend,
            )
            self.adapter_caches[context.run] = cache
        return cache

    def backend_and_cache(self, run: str) -> tuple[AdapterCache, Any]:
        """The adapter cache and backend of ``run``, built on first use; the caller holds ``adapter_lock``."""
        context = self.run_context(run)
        return self.adapter_cache(context), self.generation_backend(context)

    # -- optimize side -------------------------------------------------------------------------------
    def join_ranks(self) -> Ranks:
        """This process's ranks, joined on first use (``join_ranks``) and kept."""
        if self.ranks is None:
            self.ranks = join_ranks(self.settings)
        return self.ranks

    def run_optimizer(self, context: RunContext) -> Optimizer:
        """The optimizer of the run's trainer, built with it (a new trainer starts with nothing kept)."""
        trainer = self.run_trainer(context)
        if self.optimizer is None or self.optimizer.trainer is not trainer:
            from worker.optimize.job import Optimizer

            self.optimizer = Optimizer(
                context.run,
                context.config,
                trainer,
                self.bucket,
                self.client,
                self.settings.worker_id,
                between_files=_upload_pause(self.settings.upload_pause_s),
            )
        return self.optimizer

    def run_trainer(self, context: RunContext) -> Any:
        if self.trainer is None or self.trainer_run != context.run:
            from worker.optimize.ranks import BUILD

            config = context.config
            ranks = self.join_ranks()
            if ranks.distributed:  # the other ranks build theirs from the same config (worker.optimize.ranks)
                ranks.announce(BUILD, (config.model_dump_json(by_alias=True),))
            self.trainer = build_trainer(config, self.settings, ranks)
            # Unknown until a version is loaded from the bucket or version 0 is made here: a fresh LoRA init
            # on this device need not equal the published version 0.
            self.trainer.version = None
            self.trainer_run = context.run
        return self.trainer


def _upload_pause(seconds: float) -> Callable[[], None] | None:
    """The test hook ``ASYNCGRPO_UPLOAD_PAUSE_S``: sleep between a version's files (None: no pause)."""
    return None if seconds <= 0 else lambda: time.sleep(seconds)


def join_ranks(settings: WorkerSettings) -> Ranks:
    """This process's ranks: those ``torch.distributed.run`` started it among (one rank without it); call once
    per process (``WorkerRuntime.join_ranks`` keeps them)."""
    from worker.optimize.ranks import join

    place = RankSettings()
    return join(settings.rank_timeout_s, settings.device, place.world_size, place.local_rank)


def build_trainer(config: RunConfig, settings: WorkerSettings, ranks: Ranks) -> Trainer:
    """The run's trainer on this rank's device: the base model loaded, LoRA applied, sharded across ``ranks``."""
    from worker.model.policy import Policy
    from worker.optimize.trainer import Trainer

    policy = Policy.load(
        config.model.base,
        config.model.dtype,
        ranks.device(settings.device),
        settings.cache,
        attn_implementation=config.model.attn_implementation,
    )
    return Trainer.initial(policy, config, ranks)


def get_runtime(role: str, owner: WorkerApp | None = None) -> WorkerRuntime:
    """The process's runtime, built on first use and kept on ``owner``, the process's Celery app by default
    (imported here: a follower rank builds its trainer from this module and has no Celery app)."""
    if owner is None:
        from worker.process.celery_app import app as owner
    if owner.runtime is None:
        settings = process_settings()
        owner.runtime = WorkerRuntime(
            role=role,
            settings=settings,
            bucket=open_bucket(settings.bucket, s3_endpoint_url=settings.s3_endpoint_url),
            client=ProxyClient(settings.proxy_url, settings.token_value()),
        )
        log.info("worker.runtime_ready", role=role, worker_id=settings.worker_id, proxy=settings.proxy_url)
    return owner.runtime


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


def load_reward_models_at_start(role: str) -> None:
    """On a generate worker whose run has reward models or [agent], load them (and start the tool process) now,
    before the first task (a run not created yet: at its first task). Raises ``RewardModelError``,
    ``ToolSetupError`` or ``AgentSetupError`` naming the reward, tool or template."""
    runtime = get_runtime(role)
    run = runtime.settings.run
    if role != "generate" or run is None:
        return
    try:
        context = runtime.run_context(run)
    except (RunNotFound, BucketError) as error:  # the first task loads them
        log.info("worker.reward_models_deferred", run=run, reason=str(error))
        return
    with runtime.adapter_lock:  # the prefetcher may be building this run's backend meanwhile
        runtime.run_reward_models(context)
        runtime.run_agent(context)


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
        offers=runtime.version_offers,
    )
    runtime.prefetcher.start()
    log.info("worker.prefetch_started", wait_s=settings.prefetch_wait_s)


# ---- the prefetcher: each new adapter version loaded as soon as it is published ----


Prepare = Callable[[str], tuple[AdapterCache, GenerationBackend]]
"""Given a run name, the worker's adapter cache and backend for it (built on first use); called under the lock."""


class AdapterPrefetcher:
    """A daemon thread: long poll, stage, then load under ``lock``. ``start()``/``stop()`` like the heartbeat."""

    def __init__(
        self,
        client: ProxyClient,
        bucket: Bucket,
        staging_root: Path,
        prepare: Prepare,
        lock: threading.RLock,
        *,
        wait_s: float = 20.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        max_attempts: int = 3,
        offers: VersionOffers | None = None,
    ) -> None:
        self.client = client
        self.offers = offers
        """Where each verified version is offered to a task that follows new versions before the lock is waited
        for (None: never offered)."""
        self.bucket = bucket
        self.staging_root = staging_root
        self.prepare = prepare
        self.lock = lock
        self.wait_s = wait_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_attempts = max_attempts
        self.loaded_version: int | None = None
        """The newest version this thread loaded (for heartbeats and tests)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="asyncgrpo-prefetch", daemon=True)

    def start(self) -> None:
        # Leftovers of a process killed mid-download (its finally never ran); the folder is this worker's own.
        shutil.rmtree(self.staging_root, ignore_errors=True)
        self._thread.start()

    def stop(self, timeout_s: float = 0.0) -> None:
        """Stop after the current poll (at most ``wait_s``); waits ``timeout_s`` for the thread to end."""
        self._stop.set()
        if timeout_s > 0 and self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def close(self, timeout_s: float = 30.0) -> bool:
        """At process exit: stop, wait for a load in progress, and keep the lock so that none starts.

        A daemon thread inside a torch op when the interpreter finalizes aborts the process ("terminate
        called without an active exception"), so the exit path takes the lock and never gives it back.
        False if a load still held it after ``timeout_s``."""
        self._stop.set()
        return self.lock.acquire(timeout=timeout_s)

    def _loop(self) -> None:
        after = -1  # the newest version handled (loaded, or given up on)
        failures = 0  # consecutive failures, for the backoff
        attempts = 0  # failed attempts on the version in hand
        while not self._stop.is_set():
            try:
                latest = self.client.latest_version(after=after, wait_s=self.wait_s)
            except Exception as error:  # proxy down or restarting, a bad answer: poll again later
                failures += 1
                level = log.warning if isinstance(error, (ProxyError, httpx.HTTPError)) else log.exception
                level("generate.prefetch_poll_failed", error=str(error), failures=failures)
                self._stop.wait(self._delay(failures))
                continue
            if latest.version <= after or latest.manifest_sha256 is None or self._stop.is_set():
                failures = 0
                continue  # the wait ran out with nothing new (or no version yet): poll again
            if self.offers is not None:  # heard before the download: a task sampling may stop at once
                self.offers.heard(latest.run, latest.version)
            try:
                self.load(latest)
            except Exception as error:  # any failure is logged and retried; the task path still works
                failures += 1
                attempts += 1
                gave_up = attempts >= self.max_attempts
                log.error(
                    "generate.prefetch_failed",
                    version=latest.version,
                    error=str(error),
                    error_kind=type(error).__name__,
                    attempt=attempts,
                    gave_up=gave_up,
                )
                if gave_up:  # left to the task path, which refuses it the same way if it is broken
                    after, attempts = latest.version, 0
                self._stop.wait(self._delay(failures))
                continue
            after, failures, attempts = latest.version, 0, 0

    def _delay(self, failures: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, failures - 1))

    def load(self, latest: LatestVersion) -> None:
        """Download and verify ``latest``, then cache and load it under the lock (raises on any failure)."""
        assert latest.manifest_sha256 is not None
        version = latest.version
        started = time.perf_counter()
        # Verified outside the lock: a task may be sampling meanwhile. fetch_version leaves nothing on a mismatch.
        staged = self.staging_root / f"{bucket_keys.adapter_name(version)}-{uuid.uuid4().hex}"
        try:
            fetch_version(
                self.bucket,
                latest.run,
                version,
                staged,
                expected_manifest_sha256=latest.manifest_sha256,
                names=bucket_keys.ADAPTER_FILE_NAMES,
            )
            fetched = time.perf_counter()
            # A task sampling under the lock and following new versions takes it from here (worker.generate.inflight).
            offer = StagedVersion(latest.run, version, latest.manifest_sha256, staged)
            if self.offers is not None:
                self.offers.offer(offer)
            with self.lock:
                if self._stop.is_set():  # the process is exiting (see close)
                    return
                locked = time.perf_counter()
                if self.offers is None or self.offers.withdraw(offer):
                    cache, backend = self.prepare(latest.run)
                    path = cache.get(version, latest.manifest_sha256, staged=staged)
                    backend.load_adapter(bucket_keys.adapter_name(version), version, path)
                loaded = time.perf_counter()
                # Wall clock, for measuring publish -> loaded across processes (benchmarks/bench_adapter_sync.py).
                loaded_at = time.time()
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        self.loaded_version = version
        log.info(
            "generate.adapter_prefetched",
            run=latest.run,
            version=version,
            fetch_s=round(fetched - started, 4),
            lock_wait_s=round(locked - fetched, 4),
            load_s=round(loaded - locked, 4),
            loaded_at=loaded_at,
        )
