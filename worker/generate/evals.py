"""One eval task (``[eval]``) as an object (``EvalTask``): lease the version, sample the held-out prompts of
the task, score them, post the chunk's summary to the proxy.

It runs on a generate worker between its generate tasks, with the same backend, adapter cache and backend lock,
so an old version is loaded like any other. Sampling uses the eval settings (``eval.samples_per_prompt``,
``eval.temperature``, 0 being greedy; ``eval.max_completion_length``), scoring the eval rewards (the run's when
``eval.rewards`` is empty). The summary is sums (``asyncgrpo.protocol.evals.EvalChunkSummary``): the proxy merges
a version's chunks and writes its record. Nothing is written to the bucket and nothing reaches a rollout.

pass@k is the unbiased estimator of Chen et al. (2021): the chance that at least one of k completions drawn
without replacement from n sampled ones (c of them correct) is correct, ``1 - C(n-c, k) / C(n, k)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import comb
from typing import Any

import structlog

from asyncgrpo.protocol.errors import Cancelled, NotHolder
from asyncgrpo.protocol.evals import (
    EXAMPLE_CHARS,
    EvalChunkSummary,
    EvalExample,
    EvalLeaseGrant,
    EvalResultRequest,
)
from asyncgrpo.run.config import RunConfig
from worker.algo.math_scoring import MathVerifier
from worker.algo.rewards import RewardFailed, ScoredReward, score_completions
from worker.generate.agent import AgentCompletion, as_generation_result, converse, environment_rewards
from worker.generate.backend import GenerationBackend, GenerationResult, Message, chat_messages, fed_prompts
from worker.generate.task_context import TaskContext, release_quietly

log = structlog.get_logger()


@dataclass
class EvalResult:
    """What one eval task did; the Celery task logs and returns its ``summary()``."""

    task_id: str
    status: str  # recorded | ended (the proxy no longer wanted it)
    version: int = -1
    prompts: int = 0
    prompts_failed: int = 0
    chunks_left: int | None = None
    reward_mean: float | None = None

    def summary(self) -> dict[str, Any]:
        return asdict(self)


class EvalTask:
    """One eval task: ``run()`` (once) leases the version the proxy names for the task and walks the phases top to
    bottom, on the task's slice of the run's held-out prompts (``TaskContext.eval_prompts``). The context's reward
    models score when the eval rewards include one; with [agent], the eval prompts are conversations too."""

    def __init__(self, context: TaskContext, task_id: str) -> None:
        self.context = context
        self.config = context.config
        self.task_id = task_id
        self.originals: dict[int, dict[str, Any]] = {}  # each fed record's stored record, by the fed one's id
        self.add_special_tokens = True  # False for chat-templated text (``FedPrompts.add_special_tokens``)

    def run(self) -> EvalResult:
        context = self.context
        try:
            grant = context.client.eval_lease(self.task_id, context.worker_id)
        except Cancelled as error:
            log.info("generate.eval_skipped", task_id=self.task_id, reason=str(error))
            return EvalResult(self.task_id, "ended")
        prompts = context.eval_prompts[grant.prompt_start : grant.prompt_start + grant.prompt_count]
        with context.leased_adapter(grant.lease_id, grant.ttl_s, grant.version, grant.manifest_sha256) as (_, adapter):
            usable, chats = self.prompts(prompts)
            seed = (self.config.seed * 1_000_003 + grant.version) % (2**31 - 1)
            result = None
            environment_scores: dict[str, list[list[float]]] = {}
            if usable and context.agent is not None:
                result, usable, environment_scores = self.converse(adapter, usable, chats, seed)
            elif usable:
                result = self.sample(adapter, usable, seed)
        summary = self.score(result, usable, chats, environment_scores, failed=len(prompts) - len(usable))
        return self.post(grant, summary)

    # ---- the phases, in order ----

    def prompts(self, prompts: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[int, list[Message]]]:
        """The prompt records that can be sampled, each with its fed text as ``prompt`` (the chat-templated one
        when [eval.dataset] asks for it, as for training prompts), and the chat of each fed record by ``id`` (for
        a reward model's own chat template), taken before its prompt became the fed text."""
        context, cfg = self.context, self.config.eval
        fed = fed_prompts(prompts, range(len(prompts)), cfg.dataset, context.backend.tokenizer, context.tools_of)
        self.add_special_tokens = fed.add_special_tokens
        fed_records = [{**record, "prompt": fed.texts[index]} for index, record in enumerate(prompts)]
        self.originals = {id(fed): record for record, fed in zip(prompts, fed_records, strict=True)}
        limit = self.config.model.max_prompt_length
        usable = _usable(fed_records, context.backend, limit, fed.add_special_tokens)
        chats = {id(fed): chat_messages(record, cfg.dataset) for record, fed in zip(prompts, fed_records, strict=True)}
        return usable, chats

    def sampling(self, seed: int) -> dict[str, Any]:
        """How an eval samples (sampling and conversing alike): [eval]'s settings, the run's completion budget
        where [eval] sets none, top_p 1."""
        cfg = self.config.eval
        return {
            "samples_per_prompt": cfg.samples_per_prompt,
            "max_completion_length": cfg.max_completion_length or self.config.sampling.max_completion_length,
            "temperature": cfg.temperature,
            "top_p": 1.0,
            "seed": seed,
        }

    def sample(self, adapter: str, usable: list[dict[str, Any]], seed: int) -> GenerationResult:
        """The usable prompts' completions, sampled with the eval settings."""
        return self.context.backend.generate(
            [record["prompt"] for record in usable],
            adapter=adapter,
            **self.sampling(seed),
            add_special_tokens=self.add_special_tokens,
        )

    def converse(
        self, adapter: str, usable: list[dict[str, Any]], chats: dict[int, list[Message]], seed: int
    ) -> tuple[GenerationResult, list[dict[str, Any]], dict[str, list[list[float]]]]:
        """[agent]: the usable prompts' conversations as a generation result of the prompts whose environments
        served them (a prompt whose environment failed is a failed prompt, as one whose reward raised), those
        prompts, and their environment rewards by name."""
        context = self.context
        assert context.agent is not None
        groups, environment_scores, _ = converse(
            context.backend,
            context.agent,
            [self.originals[id(record)] for record in usable],
            [chats[id(record)] for record in usable],
            adapter=adapter,
            **self.sampling(seed),
            task_id=self.task_id,
        )
        served = [index for index, group in enumerate(groups) if group.failure is None]
        served_scores = {name: [values[i] for i in served] for name, values in environment_scores.items()}
        return as_generation_result(groups, served, adapter), [usable[index] for index in served], served_scores

    def score(
        self,
        result: GenerationResult | None,
        usable: list[dict[str, Any]],
        chats: dict[int, list[Message]],
        environment_scores: dict[str, list[list[float]]],
        *,
        failed: int,
    ) -> EvalChunkSummary:
        """The chunk's summary: the eval rewards (the run's when ``eval.rewards`` is empty) of each sampled
        prompt's completions, reward models' scores taken for the whole chunk at once."""
        context, cfg = self.context, self.config.eval
        rewards = list(cfg.rewards) or list(self.config.rewards)
        model_scores = context.scoring_models.score_groups(
            rewards,
            [record["prompt"] for record in usable],
            [chats[id(record)] for record in usable],
            [[c.text for c in r.completions] for r in result.results] if result else [[] for _ in usable],
        )
        for name, per_prompt in environment_scores.items():
            for prompt_scores, values in zip(model_scores, per_prompt, strict=True):
                prompt_scores[name] = values
        return summarize(
            result,
            usable,
            self.config,
            failed=failed,
            model_scores=model_scores,
            environment_rewards=environment_rewards(context.agent) if context.agent is not None else [],
            verifier=context.math_verifier,
        )

    def post(self, grant: EvalLeaseGrant, summary: EvalChunkSummary) -> EvalResult:
        """Post the chunk's summary to the proxy, which merges a version's chunks (the lease is released)."""
        client = self.context.client
        request = EvalResultRequest(worker_id=self.context.worker_id, lease_id=grant.lease_id, summary=summary)
        try:
            answer = client.eval_result(self.task_id, request)
        except (Cancelled, NotHolder) as error:
            # Recorded by another copy of the task, or given up meanwhile, or our lease lapsed and the task went to
            # another worker: the proxy changed nothing, and its own timeouts cover the task.
            log.info("generate.eval_result_refused", task_id=self.task_id, reason=str(error))
            release_quietly(client, grant.lease_id)
            return EvalResult(self.task_id, "ended", grant.version)
        reward_mean = summary.reward_sum / summary.completions if summary.completions else None
        return EvalResult(
            self.task_id,
            "recorded",
            grant.version,
            prompts=summary.prompts,
            prompts_failed=summary.prompts_failed,
            chunks_left=answer.chunks_left,
            reward_mean=reward_mean,
        )


def _usable(
    prompts: list[dict[str, Any]], backend: GenerationBackend, limit: int, add_special_tokens: bool
) -> list[dict[str, Any]]:
    """The prompts that can be sampled: not empty in tokens and within ``model.max_prompt_length``."""
    if not prompts:
        return []
    texts = [record["prompt"] for record in prompts]
    lengths = [len(ids) for ids in backend.tokenize(texts, add_special_tokens=add_special_tokens)]
    return [record for record, length in zip(prompts, lengths, strict=True) if 0 < length <= limit]


def summarize(
    result: GenerationResult | None,
    prompts: list[dict[str, Any]],
    config: RunConfig,
    *,
    failed: int = 0,
    model_scores: list[dict[str, list[float]]] | None = None,
    environment_rewards: list[ScoredReward] | None = None,
    verifier: MathVerifier | None = None,
) -> EvalChunkSummary:
    """Score each prompt's completions on its own (a reward that fails counts the prompt as failed) and sum
    the rewards, per-prompt pass@k and completion lengths; keep the first ``eval.examples`` examples.
    ``model_scores``: per prompt, the reward models' (and ``environment_rewards``') scores of its completions, by
    name; ``verifier`` scores ``math_verify``; a completion's tokens are the model's own (an [agent]
    conversation's tool tokens are left out)."""
    cfg = config.eval
    rewards = [*(cfg.rewards or config.rewards), *(environment_rewards or [])]
    ks = reported_ks(cfg.samples_per_prompt)
    totals: list[float] = []
    reward_sums: dict[str, float] = {}
    pass_sums = {str(k): 0.0 for k in ks}
    scored = tokens = 0
    examples: list[EvalExample] = []
    for index, (record, prompt_result) in enumerate(zip(prompts, result.results if result else [], strict=True)):
        completions = prompt_result.completions
        texts = [completion.text for completion in completions]
        try:
            values, per_reward = score_completions(
                rewards,
                [record["prompt"]] * len(texts),
                texts,
                [record.get("answer")] * len(texts),
                model_scores[index] if model_scores else None,
                verifier=verifier,
            )
        except RewardFailed as error:
            log.warning("generate.eval_prompt_unscored", prompt=record["prompt"][:80], error=str(error))
            failed += 1
            continue
        scored += 1
        totals.extend(values)
        tokens += sum(
            sum(completion.mask) if isinstance(completion, AgentCompletion) else len(completion.token_ids)
            for completion in completions
        )
        for name, scores in per_reward.items():
            reward_sums[name] = reward_sums.get(name, 0.0) + sum(scores)
        correct = sum(value >= cfg.pass_threshold for value in values)
        for k in ks:
            pass_sums[str(k)] += pass_at_k(len(values), correct, k)
        if len(examples) < cfg.examples:
            examples.append(
                EvalExample(
                    prompt=record["prompt"][:EXAMPLE_CHARS],
                    completion=texts[0][:EXAMPLE_CHARS],
                    answer=None if record.get("answer") is None else str(record["answer"])[:EXAMPLE_CHARS],
                    reward=values[0],
                )
            )
    return EvalChunkSummary(
        prompts=scored,
        prompts_failed=failed,
        completions=len(totals),
        reward_sum=sum(totals),
        reward_square_sum=sum(value * value for value in totals),
        reward_sums=reward_sums,
        pass_at_k_sums=pass_sums if scored else {},
        completion_tokens=tokens,
        examples=examples,
    )


# ---- pass@k ----


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one prompt with ``n`` completions of which ``c`` are correct; needs ``1 <= k <= n``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every draw of k holds a correct one
    return 1.0 - comb(n - c, k) / comb(n, k)


def reported_ks(samples_per_prompt: int) -> list[int]:
    """The k reported by an evaluation: 1, and the number of samples when there are more."""
    return [1] if samples_per_prompt <= 1 else [1, samples_per_prompt]
