"""The adapter prefetcher with real parts: the proxy's app on a real port over a real coordinator (Redis,
file bucket), real PEFT adapters of the tiny model, a real TransformersBackend and AdapterCache. A published
version is loaded with no task running; a task afterwards finds it loaded; a corrupted adapter object is
refused by the prefetcher (nothing loaded) and still refused by the task path."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from structlog.testing import capture_logs

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.layout import IntegrityError, write_version
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import RunConfig
from proxy.api.app import create_app
from proxy.coordinator.redis_store import RunKeys
from proxy.coordinator.service import Coordinator
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.proxy_harness import file_bucket, make_coordinator, publish_request, submit_pending
from worker.algo.rollout import decode_rollout
from worker.generate.adapter_cache import AdapterCache
from worker.generate.inflight import VersionOffers
from worker.generate.job import GenerateResult, GenerateTask
from worker.generate.partial import LeftWindow
from worker.generate.settings import GenerateSettings
from worker.generate.task_context import TaskContext
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import Policy
from worker.optimize.trainer import Trainer
from worker.process.runtime import AdapterPrefetcher
from worker.process.settings import process_settings

RUN = "r1"
PROMPTS: list[dict[str, Any]] = [{"prompt": f"{i % 10}=", "answer": str(i % 10)} for i in range(20)]


def worker_config() -> RunConfig:
    return RunConfig.model_validate(
        {"sampling": {"samples_per_prompt": 2, "max_completion_length": 3}, "rewards": [{"name": "repeat_digit"}]}
    )


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@dataclass
class World:
    coord: Coordinator
    client: ProxyClient
    trainer: Trainer
    backend: TransformersBackend
    cache: AdapterCache
    lock: threading.RLock
    prefetcher: AdapterPrefetcher
    offers: VersionOffers
    submitted: set[str] = field(default_factory=set)
    """Task ids already submitted (by a fake rollout or a real task)."""

    def publish(self, version: int, *, corrupt: bool = False) -> None:
        """Upload ``version`` as the trainer does and publish it through the proxy's HTTP API."""
        if version > 0:
            self.coord.tick()
            submit_pending(self.coord, self.submitted)
            self.coord.tick()  # claims step `version`
        files = self.trainer.version_files(version)
        manifest, sha = write_version(
            self.coord.bucket, RUN, version, files, {"step": version, "base_version": version - 1}
        )
        if corrupt:  # the object changes after its manifest was written: a torn or tampered upload
            key = manifest.file_key(RUN, "adapter_model.safetensors")
            self.coord.bucket.put(key, b"not the adapter")
        assert self.client.publish(publish_request(version, sha)).current_version == version

    def run_task(self, config: RunConfig | None = None) -> GenerateResult:
        """A dispatched generate task, run as the worker runs it (same cache, backend, lock and offers)."""
        self.coord.tick()
        task = next(t for t in self.coord.dispatcher.generate if t["task_id"] not in self.submitted)
        self.submitted.add(task["task_id"])
        return GenerateTask(self.context(config), task["task_id"], [GroupRef(**g) for g in task["groups"]]).run()

    def context(self, config: RunConfig | None = None) -> TaskContext:
        """A task's parts as the worker has them (same cache, backend, lock and offers)."""
        return TaskContext(
            run=RUN,
            config=config or worker_config(),
            prompts=PROMPTS,
            bucket=self.coord.bucket,
            client=self.client,
            backend=self.backend,
            adapter_cache=self.cache,
            worker_id="gen-1",
            backend_lock=self.lock,
            version_offers=self.offers,
        )


@pytest.fixture
def world(redis_client: Redis, tmp_path: Path, tiny_model_dir: Path, one_torch_thread: None) -> Iterator[World]:
    coord = make_coordinator(redis_client, file_bucket(tmp_path))
    coord.tick()  # the init step is claimed
    trainer = Trainer.initial(Policy.load(str(tiny_model_dir)), worker_config())
    backend = TransformersBackend(str(tiny_model_dir))
    capacity = coord.config.async_.max_staleness + 2
    cache = AdapterCache(coord.bucket, RUN, tmp_path / "cache", capacity, backend=backend)
    lock = threading.RLock()
    offers = VersionOffers()
    app = create_app(coord, API_TOKEN, run_loop=False)
    with served(app) as url, ProxyClient(url, API_TOKEN) as client:
        prefetcher = AdapterPrefetcher(
            ProxyClient(url, API_TOKEN, retries=0),
            coord.bucket,
            tmp_path / "cache" / ".prefetch",
            lambda run: (cache, backend),
            lock,
            wait_s=1.0,
            backoff_s=0.01,
            max_attempts=2,
            offers=offers,
        )
        prefetcher.start()
        try:
            yield World(coord, client, trainer, backend, cache, lock, prefetcher, offers)
        finally:
            prefetcher.stop(timeout_s=10)
            app.state.version_watch.close()


def test_a_published_version_is_loaded_before_any_task(world: World) -> None:
    world.publish(0)
    wait_until(lambda: world.backend.loaded_adapters() == ["v0"])
    world.publish(1)
    # The prefetcher records the version just after the backend's load returns: wait for the record, not the load.
    wait_until(lambda: world.prefetcher.loaded_version == 1)
    assert world.cache.versions() == [0, 1] and "v1" in world.backend.loaded_adapters()

    with capture_logs() as events:
        result = world.run_task()
    assert result.status == "admitted" and result.version == 1
    names = [event["event"] for event in events]
    assert "generation.adapter_loaded" not in names and "generate.adapter_fetched" not in names
    assert result.timings.adapter_fetch_s is not None and result.timings.adapter_fetch_s < 0.05  # a cache hit

    # The cache keeps max_staleness + 2 = 3 versions: a third preload evicts the oldest, in cache and backend.
    world.publish(2)
    world.publish(3)
    wait_until(lambda: world.prefetcher.loaded_version == 3)
    assert world.cache.versions() == [1, 2, 3] and world.backend.loaded_adapters() == ["v1", "v2", "v3"]


@pytest.mark.parametrize("inflight", ["follow", "keep"])
def test_a_task_sampling_under_the_lock_follows_the_version_the_prefetcher_offers(world: World, inflight: str) -> None:
    """v1 is published while a task samples with v0 and the lock: the prefetcher verifies it and offers it, and a
    task that follows new versions loads it between two decode steps (the prefetcher, once it has the lock,
    loads nothing again); a task that keeps its version leaves the offer to the prefetcher."""
    world.publish(0)
    wait_until(lambda: world.prefetcher.loaded_version == 0)
    plain_generate = world.backend.generate

    def publish_while_sampling(prompts: list[str], **options: Any) -> Any:
        world.publish(1)
        wait_until(lambda: world.offers.offered(RUN) == 1)  # verified, offered, and waiting for the lock
        return plain_generate(prompts, **options)

    world.backend.generate = publish_while_sampling  # type: ignore[method-assign]
    config = RunConfig.model_validate(
        {
            **worker_config().model_dump(by_alias=True),
            "sampling": {"samples_per_prompt": 2, "max_completion_length": 6},
            "async": {"inflight_versions": inflight},
        }
    )
    with capture_logs() as events:
        result = world.run_task(config)
        wait_until(lambda: world.prefetcher.loaded_version == 1)
    assert result.status == "admitted" and result.version == 0
    rollout = decode_rollout(world.coord.bucket.get(bucket_keys.rollout_key(RUN, result.task_id)))
    versions = [s.token_versions for s in rollout.samples]
    loads = [e for e in events if e["event"] == "generation.adapter_loaded"]
    assert [e["version"] for e in loads] == [1], "v1 loaded once, by whichever thread had the offer"
    if inflight == "keep":
        assert result.versions_followed == 0 and versions == [None] * len(versions)
    else:
        assert result.versions_followed == 1
        followed = [v for v in versions if v is not None]
        assert followed, "some completion outlived its first token"
        assert all(v[0] == 0 and set(v[1:]) == {1} for v in followed)
        unfollowed = [s for s, v in zip(rollout.samples, versions, strict=True) if v is None]
        assert all(len(s.completion_token_ids) == 1 for s in unfollowed), "ended before the switch"
    assert world.offers.offered(RUN) is None and "v1" in world.backend.loaded_adapters()


def test_a_task_stops_once_the_prefetcher_hears_a_version_past_its_window(world: World) -> None:
    """max_staleness 0: v1 is published while a task samples with v0, so the proxy would refuse its rollout. The
    prefetcher hears of v1 before it downloads it, and the task stops at its next decode step, hands itself back
    and lets its lease go, ending its hold (the proxy does not take the task for a dead worker's); nothing is
    written. The next delivery leases v1 and is admitted."""
    world.publish(0)
    wait_until(lambda: world.prefetcher.loaded_version == 0)
    plain_generate = world.backend.generate

    def publish_while_sampling(prompts: list[str], **options: Any) -> Any:
        world.publish(1)
        wait_until(lambda: world.offers.published(RUN) == 1)
        return plain_generate(prompts, **options)

    world.backend.generate = publish_while_sampling  # type: ignore[method-assign]
    config = RunConfig.model_validate(
        {
            **worker_config().model_dump(by_alias=True),
            "sampling": {"samples_per_prompt": 2, "max_completion_length": 6},
            "async": {"max_staleness": 0},
        }
    )
    with pytest.raises(LeftWindow, match="v1 was published"):
        world.run_task(config)
    world.backend.generate = plain_generate  # type: ignore[method-assign]
    redis = world.coord.store.redis
    (task_id,) = [t for t in world.submitted if redis.hget(RunKeys(RUN).task(t), "state") == "inflight"]
    assert "worker_id" not in redis.hgetall(RunKeys(RUN).task(task_id)), "its hold ended with the release"
    assert world.coord.bucket.head(bucket_keys.rollout_key(RUN, task_id)) is None

    wait_until(lambda: world.prefetcher.loaded_version == 1)
    dispatched = next(t for t in world.coord.dispatcher.generate if t["task_id"] == task_id)
    context = world.context(config)
    again = GenerateTask(context, task_id, [GroupRef(**g) for g in dispatched["groups"]]).run()
    assert (again.status, again.version) == ("admitted", 1)


def test_close_keeps_the_lock_so_nothing_loads_while_the_process_exits(world: World) -> None:
    world.publish(0)
    wait_until(lambda: world.prefetcher.loaded_version == 0)
    assert world.prefetcher.close(timeout_s=10)  # what the worker's exit path does
    try:
        world.publish(1)
        world.prefetcher._thread.join(timeout=10)
        assert not world.prefetcher._thread.is_alive()
        assert world.backend.loaded_adapters() == ["v0"] and world.prefetcher.loaded_version == 0
    finally:
        world.lock.release()


def test_a_corrupted_adapter_is_refused_by_the_prefetcher_and_the_task(world: World) -> None:
    world.publish(0)
    wait_until(lambda: world.prefetcher.loaded_version == 0)
    with capture_logs() as events:
        world.publish(1, corrupt=True)
        wait_until(lambda: any(e.get("gave_up") for e in events if e["event"] == "generate.prefetch_failed"))
    failures = [e for e in events if e["event"] == "generate.prefetch_failed"]
    assert all(e["version"] == 1 and e["error_kind"] == "IntegrityError" for e in failures)
    assert "adapter_model.safetensors" in failures[-1]["error"] and len(failures) == 2
    assert world.backend.loaded_adapters() == ["v0"] and world.cache.versions() == [0]
    assert world.prefetcher.loaded_version == 0
    with pytest.raises(IntegrityError, match=r"adapter_model\.safetensors"):
        world.run_task()
    assert world.backend.loaded_adapters() == ["v0"]


def test_prefetch_is_on_by_default_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCGRPO_PREFETCH_ADAPTERS", raising=False)
    assert GenerateSettings().prefetch_adapters is True
    monkeypatch.setenv("ASYNCGRPO_PREFETCH_ADAPTERS", "false")
    assert GenerateSettings().prefetch_adapters is False


def test_an_unreachable_proxy_is_logged_and_retried(tmp_path: Path) -> None:
    from tests.support.fixtures_redis import free_port

    def never(run: str) -> tuple[AdapterCache, Any]:
        raise AssertionError("nothing to load from a proxy that never answered")

    client = ProxyClient(f"http://127.0.0.1:{free_port()}", API_TOKEN, retries=0, timeout_s=1)
    prefetcher = AdapterPrefetcher(
        client,
        file_bucket(tmp_path),
        tmp_path / "staging",
        never,
        threading.RLock(),
        wait_s=0.5,
        backoff_s=0.01,
        max_backoff_s=0.02,
    )
    with capture_logs() as events:
        prefetcher.start()
        try:
            wait_until(lambda: sum(e["event"] == "generate.prefetch_poll_failed" for e in events) >= 3, 30)
            assert prefetcher._thread.is_alive()  # still polling: the worker goes on without it
        finally:
            prefetcher.stop(timeout_s=10)
    assert prefetcher.loaded_version is None


def test_the_worker_starts_a_prefetcher_only_on_generate_workers_with_the_setting_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.support.fixtures_redis import free_port
    from worker.process import runtime
    from worker.process.celery_app import app

    monkeypatch.setenv("ASYNCGRPO_BUCKET", f"file://{tmp_path / 'bucket'}")
    monkeypatch.setenv("ASYNCGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ASYNCGRPO_PROXY_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("ASYNCGRPO_PREFETCH_WAIT_S", "0.5")

    def started(role: str, setting: str) -> AdapterPrefetcher | None:
        monkeypatch.setattr(app, "runtime", None)
        process_settings.cache_clear()  # the environment above is this test's worker process's
        monkeypatch.setenv("ASYNCGRPO_PREFETCH_ADAPTERS", setting)
        runtime.start_prefetcher(role)
        return runtime.get_runtime(role).prefetcher

    assert started("generate", "false") is None
    assert started("optimize", "true") is None
    prefetcher = started("generate", "true")
    assert prefetcher is not None and prefetcher._thread.is_alive()
    prefetcher.stop(timeout_s=10)
    assert not prefetcher._thread.is_alive()
