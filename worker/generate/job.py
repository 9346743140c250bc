"""One generate task as a plain function: lease, fetch adapter, sample, score, write, submit, release.

Idempotent by task id: the rollout key is ``rollouts/<task-id>``, so a redelivered task whose first run
already wrote its rollout submits that object again instead of generating anew, and the proxy admits a
task id at most once.

The adapter cache (``AdapterCache``): the worker's local LRU cache of verified versions (at most
``max_staleness + 2``).

Why that size: a worker may still be asked for any version inside the staleness window (``max_staleness +
1`` versions) while the next one is being published, so one more slot lets the new version load before the
oldest is dropped. Every file is checked against its manifest's sha256 before it lands in the cache
(``asyncgrpo.bucket.layout.fetch_version``), so a corrupted or half-written upload is never served.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.bucket.layout import IntegrityError, fetch_version, sha256_hex
from asyncgrpo.protocol.client import ProxyClient, process_incarnation
from asyncgrpo.protocol.errors import Cancelled, LeaseLost, NotHolder, ProxyError, StaleRollout
from asyncgrpo.protocol.records import AgentStats, GenerateTimings, RolloutExtra
from asyncgrpo.protocol.schemas import GroupRef, LeaseRequest, RejectedGroup, RolloutSubmission
from asyncgrpo.run.config import RunConfig
from worker.algo.advantages import task_advantages
from worker.algo.rewards import RewardFailed, score_completions
from worker.algo.rollout import Rollout, RolloutSample, encode_rollout, read_rollout_header
from worker.corrupt_report import report_corrupt
from worker.generate.agent import (
    AgentCompletion,
    AgentRun,
    agent_stats,
    as_generation_result,
    converse,
    environment_rewards,
)
from worker.generate.backend import (
    FedPrompts,
    GenerationBackend,
    GenerationResult,
    Message,
    chat_messages,
    fed_prompts,
)
from worker.model.reward_models import RewardModels

log = structlog.get_logger()


@dataclass
class GenerateResult:
    """What one generate task did; the task logs and returns its ``summary()`` and feeds it to the metrics."""

    task_id: str
    status: str  # admitted | duplicate | stale | cancelled | rejected | not_holder
    version: int
    groups: int
    samples: int
    tokens: int
    reused_rollout: bool
    timings: GenerateTimings = field(default_factory=GenerateTimings)
    reward_mean: float | None = None

    def summary(self) -> dict[str, Any]:
        """The task's JSON result (and its log line's fields)."""
        return {
            "task_id": self.task_id,
            "status": self.status,
            "version": self.version,
            "groups": self.groups,
            "samples": self.samples,
            "tokens": self.tokens,
            "reused_rollout": self.reused_rollout,
            "reward_mean": self.reward_mean,
            "timings": {name: round(seconds, 4) for name, seconds in self.timings.model_dump().items()},
        }


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


def run_generate_task(
    *,
    run: str,
    task_id: str,
    groups: list[GroupRef],
    config: RunConfig,
    prompts: list[dict[str, Any]],
    bucket: Bucket,
    client: ProxyClient,
    backend: GenerationBackend,
    adapter_cache: AdapterCache,
    worker_id: str,
    backend_lock: AbstractContextManager[object] | None = None,
    reward_models: RewardModels | None = None,
    agent: AgentRun | None = None,
) -> GenerateResult:
    """``backend_lock``: held while the task loads its adapter and samples, the same lock the worker's adapter
    prefetcher (``worker.generate.job``) holds to load a version, so neither sees the other half-done.
    ``reward_models``: the worker's loaded reward models (needed when the run's rewards include one).
    ``agent``: the worker's tool process and schemas (needed when the run has [agent])."""
    if config.agent is not None and agent is None:
        raise ValueError("the run has [agent]; pass the worker's AgentRun (worker.generate.agent) to sample it")
    started = time.perf_counter()
    key = bucket_keys.rollout_key(run, task_id)

    existing = bucket.head(key)
    if existing is not None:
        # A redelivery after the first attempt wrote its rollout: submit that object, generate nothing. It is
        # submitted for the worker that made it, under that worker's lease of the task: the proxy admits it only
        # if that worker still holds the task (and answers "duplicate" if it was admitted already).
        data = bucket.get(key)
        header = read_rollout_header(data)
        return _submit(
            client,
            run,
            task_id,
            header.worker_id,
            header.version,
            key,
            data,
            header.groups,
            header.extra.rejected_groups,
            GenerateTimings(),
            len(header.rewards),
            reused=True,
            started=started,
        )

    try:
        lease = client.lease(LeaseRequest(worker_id=worker_id, task_id=task_id, incarnation=process_incarnation()))
    except Cancelled as error:
        # The proxy gave the task up (timed out, its worker lost, or a late redelivery): skip it; the message is
        # acked and its prompts are already handled.
        log.info("generate.task_skipped", task_id=task_id, reason=str(error))
        return GenerateResult(task_id, "cancelled", -1, 0, 0, 0, reused_rollout=False)
    timings = GenerateTimings()
    # Includes waiting for the lock; a cache hit and a no-op load when the prefetcher got there first.
    fetch_started = time.perf_counter()
    with LeaseRenewer(client, lease.lease_id, lease.ttl_s) as keeper, backend_lock or nullcontext():
        try:
            adapter_dir = adapter_cache.get(lease.version, lease.manifest_sha256)
        except IntegrityError as error:
            report_corrupt(client, lease.version, worker_id, error, role="generate")  # before the task fails
            raise
        adapter = bucket_keys.adapter_name(lease.version)
        backend.load_adapter(adapter, lease.version, adapter_dir)
        timings.adapter_fetch_s = time.perf_counter() - fetch_started

        tools_of = (lambda record: agent.schemas_for(record.get("environment"))) if agent else None
        indices = (group.prompt_index for group in groups)
        fed = fed_prompts(prompts, indices, config.dataset, backend.tokenizer, tools_of)
        accepted, rejected = _split_bad_prompts(groups, fed, backend, config)
        samples: list[RolloutSample] = []
        tokens = 0
        stats: AgentStats | None = None
        if accepted:
            gen_started = time.perf_counter()
            chats = [chat_messages(prompts[group.prompt_index], config.dataset) for group in accepted]
            rewards: list[Any] = list(config.rewards)
            environment_scores: dict[str, list[list[float]]] = {}
            if agent is not None:
                result, environment_scores, timings.tools_s = _converse(
                    backend, agent, prompts, accepted, chats, config, adapter, task_id, rejected
                )
                rewards += environment_rewards(agent)
                failed = {r.group_id for r in rejected}
                kept = [i for i, group in enumerate(accepted) if group.group_id not in failed]
                accepted, chats = [accepted[i] for i in kept], [chats[i] for i in kept]
            else:
                result = backend.generate(
                    fed.of(accepted),
                    adapter=adapter,
                    samples_per_prompt=config.sampling.samples_per_prompt,
                    max_completion_length=config.sampling.max_completion_length,
                    temperature=config.sampling.temperature,
                    top_p=config.sampling.top_p,
                    seed=_task_seed(config.seed, task_id),
                    add_special_tokens=fed.add_special_tokens,
                )
            timings.generate_s = time.perf_counter() - gen_started
            score_started = time.perf_counter()
            texts = fed.of(accepted)
            answers = [prompts[group.prompt_index].get("answer") for group in accepted]
            # Reward models score the whole task at once, in batches; each group is then scored on its own.
            completions = [[completion.text for completion in r.completions] for r in result.results]
            scored = (reward_models or RewardModels({})).score_groups(config.rewards, texts, chats, completions)
            for name, per_group in environment_scores.items():
                for group_scores, values in zip(scored, per_group, strict=True):
                    group_scores[name] = values
            conversed = dict(zip((group.group_id for group in accepted), result.results, strict=True))
            accepted, samples, tokens, unscored = _score(result, accepted, texts, answers, config, scored, rewards)
            rejected.extend(unscored)
            if agent is not None:
                stats = agent_stats([conversed[group.group_id] for group in accepted])
            timings.score_s = time.perf_counter() - score_started
        if keeper.lost:
            log.warning("generate.submit_after_lease_lost", task_id=task_id)

    rollout = Rollout(
        run=run,
        task_id=task_id,
        version=lease.version,
        worker_id=worker_id,
        groups=accepted,
        samples=samples,
        timings=timings,
        extra=RolloutExtra(
            rejected_groups=rejected,
            prompts=fed.of(accepted),
            sampler=backend.name,
            agent=stats if agent is not None and samples else None,
        ),
    )
    data = encode_rollout(rollout)
    try:
        bucket.put(key, data)
    except BaseException:
        keeper.release()
        raise
    reward_mean = sum(s.reward for s in samples) / len(samples) if samples else None
    return _submit(
        client,
        run,
        task_id,
        worker_id,
        lease.version,
        key,
        data,
        accepted,
        rejected,
        timings,
        len(samples),
        reused=False,
        started=started,
        tokens=tokens,
        reward_mean=reward_mean,
        lease_id=lease.lease_id,
    )


def _converse(
    backend: GenerationBackend,
    agent: AgentRun,
    prompts: list[dict[str, Any]],
    accepted: list[GroupRef],
    chats: list[list[Message]],
    config: RunConfig,
    adapter: str,
    task_id: str,
    rejected: list[RejectedGroup],
) -> tuple[GenerationResult, dict[str, list[list[float]]], float]:
    """[agent]: the groups' conversations as a generation result of the groups whose environments served them
    (the others go to ``rejected`` with the reason), each kept group's environment rewards by name, and the
    seconds spent on tools."""
    groups, scores, tools_s = converse(
        backend,
        agent,
        [prompts[group.prompt_index] for group in accepted],
        chats,
        adapter=adapter,
        samples_per_prompt=config.sampling.samples_per_prompt,
        max_completion_length=config.sampling.max_completion_length,
        temperature=config.sampling.temperature,
        top_p=config.sampling.top_p,
        seed=_task_seed(config.seed, task_id),
        task_id=task_id,
    )
    kept = [index for index, group in enumerate(groups) if group.failure is None]
    for index, group in enumerate(groups):
        if group.failure is not None:
            log.warning("generate.group_unscored", group_id=accepted[index].group_id, error=group.failure)
            rejected.append(RejectedGroup(group_id=accepted[index].group_id, reason=group.failure))
    kept_scores = {name: [per_group[index] for index in kept] for name, per_group in scores.items()}
    return as_generation_result(groups, kept, adapter), kept_scores, tools_s


def _task_seed(run_seed: int, task_id: str) -> int:
    # Deterministic per task (a redelivered task samples the same way), different across tasks.
    return (run_seed * 1_000_003 + int(sha256_hex(task_id.encode())[:8], 16)) % (2**31 - 1)


def _split_bad_prompts(
    groups: list[GroupRef], fed: FedPrompts, backend: GenerationBackend, config: RunConfig
) -> tuple[list[GroupRef], list[RejectedGroup]]:
    accepted: list[GroupRef] = []
    rejected: list[RejectedGroup] = []
    limit = config.model.max_prompt_length
    in_range = [group for group in groups if group.prompt_index in fed.texts]
    for group in groups:
        if group not in in_range:
            rejected.append(
                RejectedGroup(group_id=group.group_id, reason=f"prompt index {group.prompt_index} out of range")
            )
    lengths = backend.tokenize(fed.of(in_range), add_special_tokens=fed.add_special_tokens) if in_range else []
    for group, token_ids in zip(in_range, lengths, strict=True):
        length = len(token_ids)
        if length == 0:
            # Nothing to condition on: the backend could not sample from it (invariant 9, per group).
            rejected.append(RejectedGroup(group_id=group.group_id, reason="empty_prompt"))
            continue
        if length > limit:
            reason = f"prompt {group.prompt_index} has {length} tokens > model.max_prompt_length={limit}"
            rejected.append(RejectedGroup(group_id=group.group_id, reason=reason))
            continue
        accepted.append(group)
    return accepted, rejected


def _score(
    result: Any,
    groups: list[GroupRef],
    texts: list[str],
    answers: list[str | None],
    config: RunConfig,
    scored: list[dict[str, list[float]]] | None = None,
    rewards: list[Any] | None = None,
) -> tuple[list[GroupRef], list[RolloutSample], int, list[RejectedGroup]]:
    """Score each group on its own: a group whose reward raises or is not finite is rejected with its reason
    and the others are kept; then the advantages of the kept groups, together (``loss.scale_rewards = "batch"``
    and ``normalize_then_sum`` normalise over the task). ``rewards``: the run's rewards and its environments'
    (default: ``config.rewards``). Returns (groups kept, their samples, their model tokens, groups rejected)."""
    rewards = list(config.rewards) if rewards is None else rewards
    kept: list[tuple[int, list[float], dict[str, list[float]]]] = []
    rejected: list[RejectedGroup] = []
    for group_index, prompt_result in enumerate(result.results):
        completions = prompt_result.completions
        try:
            totals, per_reward = score_completions(
                rewards,
                [texts[group_index]] * len(completions),
                [completion.text for completion in completions],
                [answers[group_index]] * len(completions),
                scored[group_index] if scored else None,
            )
        except RewardFailed as error:
            log.warning("generate.group_unscored", group_id=groups[group_index].group_id, error=str(error))
            rejected.append(RejectedGroup(group_id=groups[group_index].group_id, reason=error.reason))
            continue
        kept.append((group_index, totals, per_reward))
    if not kept:
        return [], [], 0, rejected
    names = [reward.name for reward in rewards]
    table = [[per_reward[name][i] for name in names] for _, totals, per_reward in kept for i in range(len(totals))]
    advantages = task_advantages(
        table,
        [reward.weight for reward in rewards],
        config.sampling.samples_per_prompt,
        scale_rewards=config.loss.scale_rewards,
        aggregation=config.loss.multi_objective_aggregation,
    )
    samples: list[RolloutSample] = []
    tokens = 0
    for position, (group_index, totals, per_reward) in enumerate(kept):
        prompt_result = result.results[group_index]
        for i, completion in enumerate(prompt_result.completions):
            # A conversation has its own prompt (its environment's reset text) and tool tokens masked out.
            conversation = completion if isinstance(completion, AgentCompletion) else None
            prompt_ids = conversation.prompt_token_ids if conversation else prompt_result.prompt_token_ids
            tokens += sum(conversation.mask) if conversation else len(completion.token_ids)
            samples.append(
                RolloutSample(
                    group_index=position,  # the index among the groups the rollout keeps
                    prompt_token_ids=list(prompt_ids),
                    completion_token_ids=list(completion.token_ids),
                    completion_mask=list(conversation.mask) if conversation else None,
                    behavior_logprobs=list(completion.logprobs),
                    reward=float(totals[i]),
                    advantage=float(advantages[len(samples)]),
                    finish_reason=completion.finish_reason,
                    rewards_by_name={name: float(values[i]) for name, values in per_reward.items()},
                )
            )
    return [groups[group_index] for group_index, _, _ in kept], samples, tokens, rejected


def _submit(
    client: ProxyClient,
    run: str,
    task_id: str,
    worker_id: str,
    version: int,
    key: str,
    data: bytes,
    groups: list[GroupRef],
    rejected: list[RejectedGroup],
    timings: GenerateTimings,
    num_samples: int,
    *,
    reused: bool,
    started: float,
    tokens: int = 0,
    reward_mean: float | None = None,
    lease_id: str | None = None,
) -> GenerateResult:
    # Free-form figures about the task; the proxy decides nothing on them.
    stats: dict[str, float | int | None] = {"tokens": tokens, **timings.model_dump()}
    if reward_mean is not None:
        stats["reward_mean"] = reward_mean
    submission = RolloutSubmission(
        task_id=task_id,
        worker_id=worker_id,
        version=version,
        key=key,
        sha256=sha256_hex(data),
        group_ids=[group.group_id for group in groups],
        num_samples=num_samples,
        rejected_groups=rejected,
        stats=stats,
        lease_id=lease_id,
    )
    try:
        status = client.submit_rollout(submission).status
    except StaleRollout as error:
        log.warning("generate.rollout_stale", task_id=task_id, error=str(error))
        status = "stale"
    except Cancelled as error:
        log.warning("generate.rollout_cancelled", task_id=task_id, error=str(error))
        status = "cancelled"
    except NotHolder as error:
        # Not this lease's task (re-leased by another worker, or another rollout admitted): drop the work, and
        # report no failure, which would cancel the task under its holder. The proxy released nothing.
        log.warning("generate.rollout_not_holder", task_id=task_id, error=str(error))
        status = "not_holder"
        if lease_id is not None:
            release_quietly(client, lease_id)
    timings = timings.model_copy(update={"task_s": time.perf_counter() - started})
    return GenerateResult(
        task_id=task_id,
        status=status,
        version=version,
        groups=len(groups),
        samples=num_samples,
        tokens=tokens,
        reused_rollout=reused,
        timings=timings,
        reward_mean=reward_mean,
    )


def release_quietly(client: ProxyClient, lease_id: str) -> None:
    try:
        client.release(lease_id)
    except ProxyError as error:  # the lease's TTL is the backstop
        log.info("generate.lease_release_failed", lease_id=lease_id, error=str(error))


# ---- the adapter cache: verified versions, at most max_staleness + 2 ----


class AdapterCache:
    def __init__(
        self,
        bucket: Bucket,
        run: str,
        root: Path,
        capacity: int,
        backend: GenerationBackend | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"adapter cache capacity must be >= 1, got {capacity}")
        self.bucket = bucket
        self.run = run
        self.root = root / bucket_keys.check_run_name(run) / "adapters"
        self.capacity = capacity
        self.backend = backend
        """Told to drop a version evicted from the cache (None: the cache alone)."""
        self._entries: OrderedDict[int, tuple[Path, str]] = OrderedDict()
        self.last_fetch_s = 0.0

    def versions(self) -> list[int]:
        return list(self._entries)

    def get(self, version: int, manifest_sha256: str, staged: Path | None = None) -> Path:
        """The local folder of ``version``; downloads and verifies it on a miss.

        ``staged``: a folder the caller already fetched and verified against ``manifest_sha256`` with
        ``fetch_version`` (the prefetcher, outside the worker's lock); on a miss it is moved in instead of
        downloading again. Not thread-safe: callers hold the worker's backend lock."""
        entry = self._entries.get(version)
        if entry is not None and entry[1] == manifest_sha256:
            self._entries.move_to_end(version)
            self.last_fetch_s = 0.0
            return entry[0]
        if entry is not None:
            # Same number, other manifest: never serve it (a version is immutable once published).
            self._evict(version)
        started = time.perf_counter()
        path = self.root / bucket_keys.adapter_name(version)
        if path.exists():
            shutil.rmtree(path)
        if staged is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            staged.rename(path)
        else:
            fetch_version(
                self.bucket,
                self.run,
                version,
                path,
                expected_manifest_sha256=manifest_sha256,
                names=bucket_keys.ADAPTER_FILE_NAMES,  # the trainer state is the trainer's: never downloaded here
            )
        self.last_fetch_s = time.perf_counter() - started
        seconds = round(self.last_fetch_s, 4)
        log.info("generate.adapter_fetched", version=version, seconds=seconds, staged=staged is not None)
        self._entries[version] = (path, manifest_sha256)
        while len(self._entries) > self.capacity:
            oldest = next(iter(self._entries))
            self._evict(oldest)
        return path

    def _evict(self, version: int) -> None:
        path, _ = self._entries.pop(version)
        if self.backend is not None:
            self.backend.drop_adapter(bucket_keys.adapter_name(version))
        shutil.rmtree(path, ignore_errors=True)
