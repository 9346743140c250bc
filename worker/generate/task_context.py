"""What a generate or eval task works with (``TaskContext``), and the set-up both make: keep the task's
lease alive (``LeaseRenewer``) and get the leased version's adapter into the backend.

The context is the worker's parts for one run, which the worker's runtime builds once per run and the Celery
entry (``worker.process.tasks``) hands each task: the run's config and prompts, the bucket, the proxy client, the
backend, the adapter cache, the reward models, the math-verify helper and [agent]'s tools. A task holds it and
reads it; it never changes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.bucket.layout import IntegrityError
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.errors import LeaseLost, ProxyError
from asyncgrpo.run.config import RunConfig
from worker.algo.math_scoring import MathVerifier
from worker.corrupt_report import report_corrupt
from worker.generate.adapter_cache import AdapterCache
from worker.generate.agent import AgentRun
from worker.generate.backend import GenerationBackend
from worker.generate.inflight import Follower, VersionOffers
from worker.generate.partial import StopRequest
from worker.model.reward_models import RewardModels

log = structlog.get_logger()


@dataclass(frozen=True)
class TaskContext:
    """The worker's parts a generate or eval task of ``run`` works with."""

    run: str
    config: RunConfig
    bucket: Bucket
    client: ProxyClient
    backend: GenerationBackend
    adapter_cache: AdapterCache
    worker_id: str
    prompts: list[dict[str, Any]] = field(default_factory=list)
    """The run's training prompts (a generate task's groups index them)."""
    eval_prompts: list[dict[str, Any]] = field(default_factory=list)
    """The held-out prompts of ``[eval]`` (an eval task samples a slice of them)."""
    backend_lock: AbstractContextManager[object] | None = None
    """Held while a task loads its adapter and samples: the lock the worker's adapter prefetcher
    (``worker.process.runtime``) holds to load a version, so neither sees the other half-done."""
    reward_models: RewardModels | None = None
    """The worker's loaded reward models (needed when the run's rewards include one)."""
    math_verifier: MathVerifier | None = None
    """The worker's math-verify helper (needed when the run's rewards include ``math_verify``)."""
    agent: AgentRun | None = None
    """The worker's tool processes and schemas (needed when the run has [agent])."""
    version_offers: VersionOffers | None = None
    """The versions the worker's prefetcher verified, which a task following new versions loads while it samples
    (``worker.generate.inflight``)."""
    stop: StopRequest | None = None
    """Whether the worker was told to stop: a task saving partial sequences saves them and hands itself back
    (``worker.generate.partial``)."""

    def follower(self) -> Follower:
        """What a task that follows new versions asks between two decode steps (or two agent turns)."""
        return Follower(self.run, self.adapter_cache, self.backend, self.version_offers)

    @property
    def scoring_models(self) -> RewardModels:
        """The reward models to score with (none loaded: the run has no model reward)."""
        return self.reward_models or RewardModels({})

    @property
    def tools_of(self) -> Callable[[Mapping[str, Any]], list[dict]] | None:
        """[agent]: the tool schemas the template shows the model for a prompt record (None without [agent])."""
        agent = self.agent
        return (lambda record: agent.schemas_for(record.get("environment"))) if agent else None

    @contextmanager
    def leased_adapter(
        self, lease_id: str, ttl_s: float, version: int, manifest_sha256: str
    ) -> Iterator[tuple[LeaseRenewer, str]]:
        """For the block: the lease renewed in the background, the backend lock held, and ``version``'s adapter
        fetched (verified against ``manifest_sha256``; a corrupted object is reported, then raised) and loaded
        into the backend. Yields the renewer and the adapter's name."""
        with LeaseRenewer(self.client, lease_id, ttl_s) as renewer, self.backend_lock or nullcontext():
            try:
                adapter_dir = self.adapter_cache.get(version, manifest_sha256)
            except IntegrityError as error:
                report_corrupt(self.client, version, self.worker_id, error, role="generate")  # before the task fails
                raise
            adapter = bucket_keys.adapter_name(version)
            self.backend.load_adapter(adapter, version, adapter_dir)
            yield renewer, adapter


class LeaseRenewer:
    """Renews a lease from a background thread while generation runs.

    After a clean exit the lease is handed to the submission, which releases it at the proxy (one round
    trip less per task); after a failure, or with ``release()`` when no submission will be made, the lease
    is released explicitly. A release that never arrives (the process died) only lets the lease lapse at
    its TTL.
    """

    def __init__(self, client: ProxyClient, lease_id: str, ttl_s: float) -> None:
        self.client = client
        self.lease_id = lease_id
        self.interval_s = max(ttl_s / 3.0, 0.05)
        self.lost = False
        self._release_on_stop = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="asyncgrpo-lease", daemon=True)

    def __enter__(self) -> LeaseRenewer:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            # A hand-back (preemption, a stop after saving partial sequences): release now, not from the daemon
            # thread the exiting process may take with it. The release ends this worker's hold on the task
            # (release_lease.lua), so its silence after it exits is not taken for a dead holder's.
            self.release()
            return
        # On failure the renewal thread releases the lease on its way out, off the task's path.
        self._release_on_stop = exc_type is not None
        self._stop.set()

    def release(self) -> None:
        """Release now: the submission that would have released the lease will not be made."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._release()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.client.renew(self.lease_id)
            except LeaseLost:
                # The version may be collected now; we keep our local copy and let the proxy judge staleness.
                self.lost = True
                log.warning("generate.lease_lost", lease_id=self.lease_id)
                return
            except ProxyError as error:
                log.warning("generate.lease_renew_failed", lease_id=self.lease_id, error=str(error))
        if self._release_on_stop:
            self._release()

    def _release(self) -> None:
        try:
            self.client.release(self.lease_id)
        except Exception as error:  # best effort, often from the background thread: the TTL is the backstop
            log.info("generate.lease_release_failed", lease_id=self.lease_id, error=str(error))


def release_quietly(client: ProxyClient, lease_id: str) -> None:
    try:
        client.release(lease_id)
    except ProxyError as error:  # the lease's TTL is the backstop
        log.info("generate.lease_release_failed", lease_id=lease_id, error=str(error))
