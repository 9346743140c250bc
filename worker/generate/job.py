"""One generate task as an object (``GenerateTask``), its phases in the order a rollout goes through them:
lease the task and load its version's adapter, the prompts it can sample, sample (or converse, with [agent]),
score, write the rollout, submit it.

Idempotent by task id: the rollout key is ``rollouts/<task-id>``, so a redelivered task whose first run
already wrote its rollout submits that object again instead of generating anew, and the proxy admits a
task id at most once. A task interrupted while it sampled saved its unfinished sequences
(``worker.generate.partial``); whichever task samples those prompts next continues them.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.layout import sha256_hex
from asyncgrpo.protocol.client import process_incarnation
from asyncgrpo.protocol.errors import Cancelled, NotHolder, StaleRollout
from asyncgrpo.protocol.records import AgentStats, GenerateTimings, RolloutExtra
from asyncgrpo.protocol.schemas import GroupRef, LeaseGrant, LeaseRequest, RejectedGroup, RolloutSubmission
from asyncgrpo.run.config import RunConfig
from worker.algo.advantages import task_advantages
from worker.algo.math_scoring import MathVerifier
from worker.algo.rewards import RewardFailed, score_completions
from worker.algo.rollout import Rollout, RolloutSample, encode_rollout, read_rollout_header
from worker.generate.agent import (
    AgentCompletion,
    agent_stats,
    as_generation_result,
    converse,
    environment_rewards,
)
from worker.generate.backend import FedPrompts, GenerationBackend, GenerationResult, Message, chat_messages, fed_prompts
from worker.generate.inflight import Follower
from worker.generate.partial import PartialStore, Resumption, StaleWatch, TaskCheckpoints, resume
from worker.generate.task_context import LeaseRenewer, TaskContext, release_quietly

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
    versions_followed: int = 0  # newer versions its sequences moved onto (async.inflight_versions = "follow")
    tokens_resumed: int = 0  # completion tokens continued from partial sequences an interrupted task saved
    partials_discarded: int = 0  # saved groups that did not fit the task, sampled afresh
    partial_saves: int = 0  # times the task saved its unfinished sequences

    def summary(self) -> dict[str, Any]:
        """The task's JSON result (and its log line's fields)."""
        timings = {name: round(seconds, 4) for name, seconds in self.timings.model_dump().items()}
        return {**asdict(self), "timings": timings}


@dataclass(frozen=True)
class WrittenRollout:
    """A task's rollout object as the bucket holds it, and what its submission says of it."""

    data: bytes
    worker_id: str  # the worker that made it, whose lease of the task the submission speaks for
    version: int
    groups: list[GroupRef]
    rejected: list[RejectedGroup]
    num_samples: int
    tokens: int = 0
    reward_mean: float | None = None
    newest_version: int | None = None  # its newest token's version, where newer than ``version``
    oldest_version: int | None = None  # its oldest token's version, where older (continued partial sequences)
    resumed_tokens: int = 0  # its tokens continued from partial sequences, not sampled by this task


class GenerateTask:
    """One generate task: ``run()`` (once) walks its phases top to bottom.

    The task's context (``TaskContext``: the run, config, prompts, bucket, client, backend, adapter cache, reward
    models, agent) is held once; the groups the rollout keeps narrow phase by phase (``kept``), the others go to
    ``rejected`` with their reasons."""

    def __init__(self, context: TaskContext, task_id: str, groups: list[GroupRef]) -> None:
        if context.config.agent is not None and context.agent is None:
            raise ValueError("the run has [agent]; pass the worker's AgentRun (worker.generate.agent) to sample it")
        self.context = context
        self.config = context.config
        self.task_id = task_id
        self.groups = groups
        self.key = bucket_keys.rollout_key(context.run, task_id)
        self.seed = _task_seed(self.config.seed, task_id)
        self.timings = GenerateTimings()
        self.kept: list[GroupRef] = []
        self.rejected: list[RejectedGroup] = []
        self.started = 0.0
        self.versions_followed = 0  # newer versions the task's sequences moved onto while it sampled
        self.resumption: Resumption | None = None  # the partial sequences it continues
        self.checkpoints: TaskCheckpoints | None = None  # where it saves its own

    def run(self) -> GenerateResult:
        self.started = time.perf_counter()
        if self.context.bucket.head(self.key) is not None:
            return self.submit_written()
        lease = self.lease()
        if lease is None:
            return GenerateResult(self.task_id, "cancelled", -1, 0, 0, 0, reused_rollout=False)
        # Includes waiting for the lock; a cache hit and a no-op load when the prefetcher got there first.
        fetch_started = time.perf_counter()
        lease_of = (lease.lease_id, lease.ttl_s, lease.version, lease.manifest_sha256)
        with self.context.leased_adapter(*lease_of) as (renewer, adapter):
            self.timings.adapter_fetch_s = time.perf_counter() - fetch_started
            fed = self.prompts()
            samples: list[RolloutSample] = []
            tokens = 0
            stats: AgentStats | None = None
            if self.kept:
                gen_started = time.perf_counter()
                chats = [
                    chat_messages(self.context.prompts[group.prompt_index], self.config.dataset) for group in self.kept
                ]
                follower = self.follower()
                if self.context.agent is not None:
                    result, chats, environment_scores = self.converse(adapter, chats, lease.version, follower)
                else:
                    self.partial_rollouts(fed, lease.version)
                    result, environment_scores = self.sample(adapter, fed, follower), {}
                self.versions_followed = follower.switches if follower is not None else 0
                self.timings.generate_s = time.perf_counter() - gen_started
                score_started = time.perf_counter()
                samples, tokens, stats = self.score(result, fed, chats, environment_scores)
                self.timings.score_s = time.perf_counter() - score_started
            if renewer.lost:
                log.warning("generate.submit_after_lease_lost", task_id=self.task_id)
        written = self.write(lease, fed, samples, tokens, stats, renewer)
        self.clear_partials()
        return self.submit(written, reused=False, lease_id=lease.lease_id)

    # ---- the phases, in order ----

    def submit_written(self) -> GenerateResult:
        """A redelivery after the first attempt wrote its rollout: submit that object, generate nothing. It is
        submitted for the worker that made it, under that worker's lease of the task: the proxy admits it only
        if that worker still holds the task (and answers "duplicate" if it was admitted already)."""
        data = self.context.bucket.get(self.key)
        header = read_rollout_header(data)
        written = WrittenRollout(
            data=data,
            worker_id=header.worker_id,
            version=header.version,
            groups=header.groups,
            rejected=header.extra.rejected_groups,
            num_samples=len(header.rewards),
            newest_version=header.newest_version,
            oldest_version=header.oldest_version,
            resumed_tokens=header.extra.resumed_tokens or 0,
        )
        return self.submit(written, reused=True)

    def lease(self) -> LeaseGrant | None:
        """This worker's lease of the task; None when the proxy gave the task up (timed out, its worker lost, or
        a late redelivery): the task is skipped, its message acked, its prompts already handled."""
        request = LeaseRequest(
            worker_id=self.context.worker_id, task_id=self.task_id, incarnation=process_incarnation()
        )
        try:
            return self.context.client.lease(request)
        except Cancelled as error:
            log.info("generate.task_skipped", task_id=self.task_id, reason=str(error))
            return None

    def prompts(self) -> FedPrompts:
        """The fed text of the task's prompts; the groups whose prompt cannot be sampled are rejected."""
        context = self.context
        indices = (group.prompt_index for group in self.groups)
        fed = fed_prompts(context.prompts, indices, self.config.dataset, context.backend.tokenizer, context.tools_of)
        self.kept, self.rejected = _split_bad_prompts(self.groups, fed, context.backend, self.config)
        return fed

    def sampling(self) -> dict[str, Any]:
        """How the task samples (sampling and conversing alike): the run's settings, under the task's seed."""
        sampling = self.config.sampling
        return {
            "samples_per_prompt": sampling.samples_per_prompt,
            "max_completion_length": sampling.max_completion_length,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": self.seed,
        }

    def follower(self) -> Follower | None:
        """Where the task looks for newer versions while it samples (``async.inflight_versions = "follow"``); None
        when it keeps its leased version. Single-turn sampling follows only on a backend that can
        (``follows_versions``); conversations follow between turns on any backend."""
        context = self.context
        if self.config.async_.inflight_versions != "follow":
            return None
        if context.agent is None and not context.backend.follows_versions:
            return None
        return context.follower()

    def partial_rollouts(self, fed: FedPrompts, version: int) -> None:
        """On a backend that continues partial sequences: with ``async.partial_rollouts``, the saved sequences of
        the kept groups that this task continues (``resumption``) and where it saves its own while it samples;
        with ``stale_tokens = "drop"``, the watch that stops the task once its rollout left the window (both in
        ``checkpoints``, asked at every decode step)."""
        context, window = self.context, self.config.async_
        if not context.backend.continues_partials:
            return
        store = PartialStore(context.bucket, context.run)
        prompt_ids = context.backend.tokenize(fed.of(self.kept), add_special_tokens=fed.add_special_tokens)
        if window.partial_rollouts:
            self.resumption = resume(store, self.kept, prompt_ids, self.config, version)
        watch = None
        offers, run = context.version_offers, context.run
        if window.stale_tokens == "drop" and offers is not None:  # with "mask" a stale token is masked, not refused
            oldest = self.resumption.oldest_version(version) if self.resumption is not None else version
            watch = StaleWatch(lambda: offers.published(run), oldest, window.max_staleness)
        if not window.partial_rollouts and watch is None:
            return
        self.checkpoints = TaskCheckpoints(
            store,
            groups=self.kept,
            prompt_ids=prompt_ids,
            samples_per_prompt=self.config.sampling.samples_per_prompt,
            task_id=self.task_id,
            worker_id=context.worker_id,
            # without partial rollouts nothing is saved: the checkpoints only watch the window
            every_s=window.partial_save_every_s if window.partial_rollouts else math.inf,
            stop=context.stop if window.partial_rollouts else None,
            watch=watch,
        )

    def sample(self, adapter: str, fed: FedPrompts, follower: Follower | None = None) -> GenerationResult:
        """The kept groups' completions, sampled with the run's settings (following new versions with a
        ``follower``; continuing saved partial sequences and saving its own with ``partial_rollouts``)."""
        partial: dict[str, Any] = {}
        if self.checkpoints is not None:
            partial["checkpoints"] = self.checkpoints
        if self.resumption is not None and self.resumption.any:
            partial["partials"] = self.resumption.partials
        stop = self.checkpoints.stop if self.checkpoints is not None else None
        with stop.cooperating() if stop is not None else nullcontext():
            return self.context.backend.generate(
                fed.of(self.kept),
                adapter=adapter,
                **self.sampling(),
                add_special_tokens=fed.add_special_tokens,
                **({"follow": follower} if follower is not None else {}),
                **partial,
            )

    def clear_partials(self) -> None:
        """Once the rollout is written, the saved sequences it holds now are deleted: those it continued or
        discarded (else every later task of the prompt would read and discard them again), and its own saves."""
        continued = self.resumption is not None and (self.resumption.any or self.resumption.discarded > 0)
        saved = self.checkpoints is not None and self.checkpoints.saves > 0
        if continued or saved:
            PartialStore(self.context.bucket, self.context.run).clear([group.prompt_index for group in self.groups])

    def converse(
        self, adapter: str, chats: list[list[Message]], version: int = 0, follower: Follower | None = None
    ) -> tuple[GenerationResult, list[list[Message]], dict[str, list[list[float]]]]:
        """[agent]: the kept groups' conversations as a generation result of the groups whose environments served
        them (the others are rejected with the reason), those groups' chats, and their environment rewards by
        name; the seconds spent on tools go to the timings."""
        context = self.context
        assert context.agent is not None
        groups, scores, self.timings.tools_s = converse(
            context.backend,
            context.agent,
            [context.prompts[group.prompt_index] for group in self.kept],
            chats,
            adapter=adapter,
            **self.sampling(),
            task_id=self.task_id,
            version=version,
            follow=follower,
        )
        served = [index for index, group in enumerate(groups) if group.failure is None]
        for index, group in enumerate(groups):
            if group.failure is not None:
                log.warning("generate.group_unscored", group_id=self.kept[index].group_id, error=group.failure)
                self.rejected.append(RejectedGroup(group_id=self.kept[index].group_id, reason=group.failure))
        served_scores = {name: [per_group[index] for index in served] for name, per_group in scores.items()}
        self.kept = [self.kept[index] for index in served]
        return as_generation_result(groups, served, adapter), [chats[index] for index in served], served_scores

    def score(
        self,
        result: GenerationResult,
        fed: FedPrompts,
        chats: list[list[Message]],
        environment_scores: dict[str, list[list[float]]],
    ) -> tuple[list[RolloutSample], int, AgentStats | None]:
        """Rewards and advantages of the kept groups' completions (a group whose reward fails is rejected):
        the rollout's samples, their model tokens, and [agent]'s conversation figures."""
        context, agent = self.context, self.context.agent
        rewards: list[Any] = list(self.config.rewards) + (environment_rewards(agent) if agent is not None else [])
        texts = fed.of(self.kept)
        answers = [context.prompts[group.prompt_index].get("answer") for group in self.kept]
        # Reward models score the whole task at once, in batches; each group is then scored on its own.
        completions = [[completion.text for completion in r.completions] for r in result.results]
        scored = context.scoring_models.score_groups(self.config.rewards, texts, chats, completions)
        for name, per_group in environment_scores.items():
            for group_scores, values in zip(scored, per_group, strict=True):
                group_scores[name] = values
        conversed = dict(zip((group.group_id for group in self.kept), result.results, strict=True))
        self.kept, samples, tokens, unscored = _score(
            result, self.kept, texts, answers, self.config, scored, rewards, context.math_verifier
        )
        self.rejected.extend(unscored)
        stats = agent_stats([conversed[group.group_id] for group in self.kept]) if agent is not None else None
        return samples, tokens, stats

    def write(
        self,
        lease: LeaseGrant,
        fed: FedPrompts,
        samples: list[RolloutSample],
        tokens: int,
        stats: AgentStats | None,
        renewer: LeaseRenewer,
    ) -> WrittenRollout:
        """The rollout object, written to the bucket (the lease is released if that fails)."""
        context = self.context
        rollout = Rollout(
            run=context.run,
            task_id=self.task_id,
            version=lease.version,
            worker_id=context.worker_id,
            groups=self.kept,
            samples=samples,
            timings=self.timings,
            extra=RolloutExtra(
                rejected_groups=self.rejected,
                prompts=fed.of(self.kept),
                sampler=context.backend.name,
                agent=stats if context.agent is not None and samples else None,
                resumed_tokens=self._resumed_tokens(samples) or None,
            ),
        )
        data = encode_rollout(rollout)
        try:
            context.bucket.put(self.key, data)
        except BaseException:
            renewer.release()
            raise
        return WrittenRollout(
            data=data,
            worker_id=context.worker_id,
            version=lease.version,
            groups=self.kept,
            rejected=self.rejected,
            num_samples=len(samples),
            tokens=tokens,
            reward_mean=sum(s.reward for s in samples) / len(samples) if samples else None,
            newest_version=rollout.newest_version(),
            oldest_version=rollout.oldest_version(),
            resumed_tokens=rollout.extra.resumed_tokens or 0,
        )

    def _resumed_tokens(self, samples: list[RolloutSample]) -> int:
        """The continued tokens among the samples kept."""
        if self.resumption is None or not samples:
            return 0
        return sum(self.resumption.by_group.get(group.group_id, 0) for group in self.kept)

    def submit(self, written: WrittenRollout, *, reused: bool, lease_id: str | None = None) -> GenerateResult:
        """Submit the rollout to the proxy, under ``lease_id`` (which the proxy releases); the proxy's answer is
        the task's status."""
        client = self.context.client
        # Free-form figures about the task; the proxy decides nothing on them.
        stats: dict[str, float | int | None] = {"tokens": written.tokens, **self.timings.model_dump()}
        if written.reward_mean is not None:
            stats["reward_mean"] = written.reward_mean
        submission = RolloutSubmission(
            task_id=self.task_id,
            worker_id=written.worker_id,
            version=written.version,
            key=self.key,
            sha256=sha256_hex(written.data),
            group_ids=[group.group_id for group in written.groups],
            num_samples=written.num_samples,
            rejected_groups=written.rejected,
            stats=stats,
            lease_id=lease_id,
            newest_version=written.newest_version,
            oldest_version=written.oldest_version,
        )
        try:
            status = client.submit_rollout(submission).status
        except StaleRollout as error:
            log.warning("generate.rollout_stale", task_id=self.task_id, error=str(error))
            status = "stale"
        except Cancelled as error:
            log.warning("generate.rollout_cancelled", task_id=self.task_id, error=str(error))
            status = "cancelled"
        except NotHolder as error:
            # Not this lease's task (re-leased by another worker, or another rollout admitted): drop the work, and
            # report no failure, which would cancel the task under its holder. The proxy released nothing.
            log.warning("generate.rollout_not_holder", task_id=self.task_id, error=str(error))
            status = "not_holder"
            if lease_id is not None:
                release_quietly(client, lease_id)
        timings = self.timings.model_copy(update={"task_s": time.perf_counter() - self.started})
        return GenerateResult(
            task_id=self.task_id,
            status=status,
            version=written.version,
            groups=len(written.groups),
            samples=written.num_samples,
            tokens=written.tokens,
            reused_rollout=reused,
            timings=timings,
            reward_mean=written.reward_mean,
            versions_followed=self.versions_followed,
            tokens_resumed=written.resumed_tokens,
            partials_discarded=self.resumption.discarded if self.resumption is not None else 0,
            partial_saves=self.checkpoints.saves if self.checkpoints is not None else 0,
        )


# ---- the pure parts: which prompts can be sampled, scoring ----


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
    verifier: MathVerifier | None = None,
) -> tuple[list[GroupRef], list[RolloutSample], int, list[RejectedGroup]]:
    """Score each group on its own: a group whose reward raises or is not finite is rejected with its reason
    and the others are kept; then the advantages of the kept groups, together (``loss.scale_rewards = "batch"``
    and ``normalize_then_sum`` normalise over the task). ``rewards``: the run's rewards and its environments'
    (default: ``config.rewards``); ``verifier`` scores ``math_verify``. Returns (groups kept, their samples,
    their model tokens, groups rejected)."""
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
                verifier=verifier,
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
                    token_versions=list(completion.versions) if completion.versions is not None else None,
                )
            )
    return [groups[group_index] for group_index, _, _ in kept], samples, tokens, rejected
