"""The generate job against a real proxy (HTTP, real Redis) now that submissions are bound to their lease.

A redelivered task that finds its rollout in the bucket resubmits it for the worker that made it (admitted,
then "duplicate"); a worker whose task was leased again by another drops its rollout quietly: status
``not_holder``, no exception (so no failure report that would count an attempt and cancel the other's task),
its own lease released, and the task left in flight under its new holder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.layout import write_version
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.errors import ProxyUnavailable
from asyncgrpo.protocol.schemas import GroupRef, RolloutSubmission, SubmitResult
from asyncgrpo.run.config import RunConfig
from proxy.api.app import create_app
from proxy.coordinator.service import Coordinator
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.proxy_harness import publish_request
from worker.algo.rollout import read_rollout_header
from worker.generate.adapter_cache import AdapterCache
from worker.generate.job import GenerateResult, GenerateTask
from worker.generate.task_context import TaskContext
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import Policy
from worker.optimize.trainer import Trainer

PROMPTS: list[dict[str, Any]] = [{"prompt": f"{i % 10}=", "answer": str(i % 10)} for i in range(20)]


def config() -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"max_prompt_length": 8},
            "sampling": {"samples_per_prompt": 2, "max_completion_length": 4},
            "rewards": [{"name": "repeat_digit"}],
        }
    )


@pytest.fixture
def client(coord: Coordinator, tiny_model_dir: Path, one_torch_thread: None) -> Iterator[ProxyClient]:
    """A ProxyClient of the real proxy app on a loopback port; the run has a real v0 and tasks in flight."""
    coord.tick()
    trainer = Trainer.initial(Policy.load(str(tiny_model_dir)), config())
    _, sha = write_version(coord.bucket, coord.run, 0, trainer.version_files(0), {"step": 0, "base_version": -1})
    coord.publish(publish_request(0, sha))
    coord.tick()
    with served(create_app(coord, API_TOKEN, run_loop=False)) as url:
        yield ProxyClient(url, API_TOKEN, timeout_s=10, retries=0)


class LostAnswer(ProxyClient):
    """The first attempt's worker dies after writing its rollout, before the proxy hears of it."""

    def submit_rollout(self, submission: RolloutSubmission) -> SubmitResult:
        raise ProxyUnavailable("the worker died before it submitted")


class LeasedAgainWhileSampling(TransformersBackend):
    """While this worker samples, its task is redelivered and leased by gen-2 (this one was presumed lost)."""

    def __init__(self, model_dir: str, coord: Coordinator, task_id: str) -> None:
        super().__init__(model_dir)
        self.coord, self.task_id = coord, task_id

    def generate(self, prompts: list[str], **kwargs: Any) -> Any:
        self.coord.lease("gen-2", self.task_id)
        return super().generate(prompts, **kwargs)


def run_task(
    coord: Coordinator, client: ProxyClient, backend: TransformersBackend, task: dict, worker_id: str, cache: Path
) -> GenerateResult:
    context = TaskContext(
        run=coord.run,
        config=config(),
        prompts=PROMPTS,
        bucket=coord.bucket,
        client=client,
        backend=backend,
        adapter_cache=AdapterCache(coord.bucket, coord.run, cache, capacity=2),
        worker_id=worker_id,
    )
    return GenerateTask(context, task["task_id"], [GroupRef(**group) for group in task["groups"]]).run()


def test_a_redelivered_task_resubmits_its_rollout_for_the_worker_that_made_it(
    coord: Coordinator, client: ProxyClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    task = coord.dispatcher.generate[0]
    backend = TransformersBackend(str(tiny_model_dir))
    dying = LostAnswer(client.base_url, API_TOKEN, timeout_s=10, retries=0)
    with pytest.raises(ProxyUnavailable):
        run_task(coord, dying, backend, task, "gen-1", tmp_path / "cache-1")
    key = bucket_keys.rollout_key(coord.run, task["task_id"])
    assert read_rollout_header(coord.bucket.get(key)).worker_id == "gen-1"
    # redelivered to gen-2: it leases nothing and samples nothing, and submits gen-1's rollout for gen-1
    again = run_task(coord, client, backend, task, "gen-2", tmp_path / "cache-2")
    assert (again.status, again.reused_rollout) == ("admitted", True)
    assert coord.redis.hget(coord.keys.task(task["task_id"]), "worker_id") == "gen-1"
    # and once more (its answer lost): the same rollout from the same worker is a duplicate, not a refusal
    assert run_task(coord, client, backend, task, "gen-3", tmp_path / "cache-3").status == "duplicate"
    assert coord.status().counters["rollouts_admitted"] == 1


def test_a_worker_whose_task_was_leased_again_drops_its_rollout_quietly(
    coord: Coordinator, client: ProxyClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    task = coord.dispatcher.generate[0]
    backend = LeasedAgainWhileSampling(str(tiny_model_dir), coord, task["task_id"])
    counters = coord.status().counters
    result = run_task(coord, client, backend, task, "gen-1", tmp_path / "cache")
    assert result.status == "not_holder" and not result.reused_rollout
    tk = coord.keys.task(task["task_id"])
    assert coord.redis.hmget(tk, ["state", "worker_id"]) == ["inflight", "gen-2"], "still gen-2's to finish"
    assert [lease.worker_id for lease in coord.status().leases] == ["gen-2"], "gen-1 released its own lease"
    after = coord.status().counters
    for name in ("rollouts_admitted", "tasks_failed", "tasks_cancelled", "groups_rejected"):
        assert after.get(name, 0) == counters.get(name, 0), name
    assert coord.redis.hgetall(coord.keys.prompt_attempts) == {}, "no attempt counted against its prompts"
