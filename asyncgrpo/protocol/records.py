"""The records left in the bucket for other processes: the rollout header, the step record, the eval record.

Unlike the HTTP and task messages in ``asyncgrpo.protocol.schemas``, these are stored, so they are read long
after they were written, possibly by another version of the code: their JSON keys are the ones written
since the first release (renaming one needs a new ``format``), and they allow extra keys so that a newer
writer does not break an older reader. Pydantic only: readable without torch or numpy.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializationInfo, SerializerFunctionWrapHandler, model_serializer

from asyncgrpo.protocol.evals import EvalExample
from asyncgrpo.protocol.schemas import GroupRef, RejectedGroup

ROLLOUT_FORMAT = 1
"""Version of the rollout object's layout (tensors and header); a reader refuses any other."""


class _Stored(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Timings(_Stored):
    """Seconds per phase; a phase that did not run is left out of the JSON, as it always was."""

    @model_serializer(mode="wrap")
    def _drop_missing(self, handler: SerializerFunctionWrapHandler, _: SerializationInfo) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


# ---- the rollout object's header: runs/<run>/rollouts/<task-id>.safetensors ----


class GenerateTimings(_Timings):
    """Where a generate task's time went. Written in the rollout header (without ``task_s``, unknown then)
    and reported in the generate task's result, which feeds the worker's metrics."""

    adapter_fetch_s: float | None = None
    """Getting the leased adapter (local cache or bucket) and loading it into the backend."""
    generate_s: float | None = None
    """Sampling the completions (absent when every prompt was rejected)."""
    score_s: float | None = None
    """Computing the rewards and group advantages."""
    tools_s: float | None = None
    """Agent runs: the part of ``generate_s`` spent outside sampling: tool and environment calls, templating the
    conversations' prompts and tool answers, parsing calls."""
    task_s: float | None = None
    """The whole task, submit included (task result only)."""


class AgentStats(_Stored):
    """Per sample (in sample order) of an agent rollout: its model turns, the tool calls it made, and how many of
    them failed (raised, returned no text, timed out, crashed the tool process, or could not be parsed)."""

    turns: list[int]
    tool_calls: list[int]
    tool_failures: list[int]


class ToolFigures(_Stored):
    """An [agent] step's conversations (TRL's ``tools/*``): over its completions, the mean tool calls
    (``call_frequency``), the share of calls that failed (``failure_frequency``), the mean model turns, and the
    share of completions that called a tool at all."""

    call_frequency: float
    failure_frequency: float
    turns_mean: float
    call_rate: float
    calls: int
    failures: int

    @staticmethod
    def of(stats: list[AgentStats]) -> ToolFigures | None:
        """Over the rollouts' per-sample stats; None when no rollout is an agent's."""
        turns = [n for part in stats for n in part.turns]
        calls = [n for part in stats for n in part.tool_calls]
        failures = sum(n for part in stats for n in part.tool_failures)
        if not turns:
            return None
        return ToolFigures(
            call_frequency=sum(calls) / len(calls),
            failure_frequency=failures / sum(calls) if sum(calls) else 0.0,
            turns_mean=sum(turns) / len(turns),
            call_rate=sum(1 for n in calls if n) / len(calls),
            calls=sum(calls),
            failures=failures,
        )


class RolloutExtra(_Stored):
    """The header's open-ended part."""

    rejected_groups: list[RejectedGroup] = Field(default_factory=list)
    """Groups of the task refused as bad input (prompt too long, index out of range), with the reason; a
    redelivered task resubmits them with the rollout."""
    prompts: list[str] | None = None
    """Per accepted group, in header order: the prompt text actually fed to the model (after the chat template,
    if the run uses one; see ``worker.generate.backend``). None (and not written) in rollouts made before
    it existed, which still read and write the same bytes."""
    sampler: str | None = None
    """The generation backend whose logprobs the rollout carries ('transformers', 'vllm'): whether the
    generator-trainer correction applies by default (``loss.vllm_importance_sampling_correction`` unset). None
    (and not written) in rollouts made before it existed."""
    agent: AgentStats | None = None
    """Per sample, what its conversation did, for an ``[agent]`` run (``worker.generate.agent``); None (and not
    written) otherwise."""
    resumed_tokens: int | None = Field(None, ge=0)
    """Completion tokens continued from partial sequences an interrupted task saved (``async.partial_rollouts``;
    ``worker.generate.partial``), not sampled by this task; None (and not written) when there were none."""

    @model_serializer(mode="wrap")
    def _drop_unset_prompts(self, handler: SerializerFunctionWrapHandler, _: SerializationInfo) -> dict[str, Any]:
        data = handler(self)
        for name in ("prompts", "sampler", "agent", "resumed_tokens"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class RolloutHeader(_Stored):
    """The JSON header of a rollout object (the safetensors metadata field ``asyncgrpo``).

    Hop: written by the generate worker (``worker.generate.job``) with the tensors into
    ``runs/<run>/rollouts/<task-id>.safetensors``; read back by the same task when it is redelivered (to
    resubmit without generating again) and by the optimize worker (``worker.algo.rollout.decode_rollout``)
    for the claimed step. Per-sample lists are in sample order, groups in header order, G samples each.
    """

    format: int
    """Layout version; see ``ROLLOUT_FORMAT``."""
    run: str
    task_id: str
    """The generate task that made it; the object key is named after it."""
    version: int = Field(ge=0)
    """Adapter version the completions were sampled with: the one the task leased (what the submission and the
    claim name). Where tokens record their own versions (``async.inflight_versions = "follow"``), no token is
    older, unless ``oldest_version`` says so."""
    worker_id: str
    """The generate worker that sampled them (named when its rescoring ratio is flagged)."""
    newest_version: int | None = Field(None, ge=0, exclude_if=lambda value: value is None)
    """Where tokens record their own versions: the newest token's (what a redelivered task submits again as
    ``RolloutSubmission.newest_version``); absent when every token is ``version``'s."""
    oldest_version: int | None = Field(None, ge=0, exclude_if=lambda value: value is None)
    """Where a sequence continues a partial one an earlier task saved (``async.partial_rollouts``): the oldest
    token's version, older than ``version``, which no token is older than (what a redelivered task submits
    again as ``RolloutSubmission.oldest_version``); absent when no token is older than ``version``."""
    groups: list[GroupRef]
    """The task's accepted prompt groups, in sample order."""
    finish_reasons: list[str]
    """Per sample: ``stop`` or ``length`` (cut at max_completion_length)."""
    reward_names: list[str]
    """Reward functions with a per-sample tensor ``reward/<name>``, sorted."""
    rewards: list[float]
    """Per sample: total reward."""
    timings: GenerateTimings = Field(default_factory=GenerateTimings)
    extra: RolloutExtra = Field(default_factory=RolloutExtra)


# ---- the step record: version folder's step_record.json, copied to runs/<run>/metrics/step-S.json ----


class CorrectionFigures(_Stored):
    """The correction weights exp(trainer logprob - generator logprob) of an update or a step (TRL's
    ``sampling/importance_sampling_ratio/*`` and ``sampling/sampling_logp_difference/*``): per token, or per
    sequence in the sequence modes."""

    min: float
    mean: float
    max: float
    logp_difference_mean: float
    """Token mean of |trainer logprob - generator logprob|."""
    logp_difference_max: float

    @staticmethod
    def combine(parts: list[CorrectionFigures]) -> CorrectionFigures | None:
        """Over several updates: the extremes of their extremes, the mean of their means."""
        if not parts:
            return None
        return CorrectionFigures(
            min=min(part.min for part in parts),
            mean=sum(part.mean for part in parts) / len(parts),
            max=max(part.max for part in parts),
            logp_difference_mean=sum(part.logp_difference_mean for part in parts) / len(parts),
            logp_difference_max=max(part.logp_difference_max for part in parts),
        )


class UpdateMetrics(_Stored):
    """One optimizer update (a step takes ``async.publish_every`` of them), as the trainer measured it."""

    update: int
    """0-based index of this update in the run (drives the learning-rate schedule)."""
    loss: float
    ratio: float
    """Token mean of the importance ratio pi / pi_behaviour."""
    kl: float
    """k3 estimate of KL(behaviour || current): how far the policy moved from the one that sampled."""
    clip_low: float
    """Share of tokens clipped at 1 - epsilon_low."""
    clip_high: float
    """Share of tokens clipped at 1 + epsilon_high."""
    clip_region: float
    """Share of tokens whose ratio lies outside the clip region."""
    entropy: float
    """Token mean entropy of the policy, in nats."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    tokens: int
    """Completion tokens in the update."""
    sequences: int
    micro_batches: int
    forward_backward_s: float
    optimizer_s: float
    """Gradient clipping and the AdamW update."""
    kl_ref: float | None = None
    """KL to the base model (adapter disabled); only when loss.beta > 0."""
    importance_sampling_ratio: CorrectionFigures | None = Field(None, exclude_if=lambda value: value is None)
    """The generator-trainer correction's weights and logprob gaps; only when the update corrected a sample
    (``loss.vllm_importance_sampling_correction``). Absent otherwise, and from records written before it."""


class RolloutEntry(_Stored):
    """One rollout trained in the step."""

    task_id: str
    version: int
    """Version that sampled it; the step's base_version minus this is its staleness."""
    worker_id: str
    ratio: float | None
    """Mean ratio when rescored under ``version`` (1 when the worker served the right weights); None when it
    had no completion tokens."""
    group_ids: list[str]
    prompt_indices: list[int]
    samples: int


class FlaggedRollout(_Stored):
    """A rollout whose rescoring ratio drifted beyond loss.ratio_flag_tolerance: its worker may serve the
    wrong weights."""

    task_id: str
    worker_id: str
    ratio: float


class StepTimings(_Timings):
    """Where an optimize step's time went."""

    fetch_s: float | None = None
    """Fetching and verifying the claimed rollouts."""
    rescore_s: float | None = None
    """Rescoring them under the versions they claim: the separate forwards only (the ratios of fresh samples
    reused from the training forward cost nothing measurable)."""
    step_s: float | None = None
    """From the task's start to the record (training done, before the upload)."""
    serialize_s: float | None = None
    """Serialising the new version's files (adapter, optimizer moments, RNG)."""
    upload_s: float | None = None
    """Writing the new version's files and manifest. Not in the version folder's copy of the record (it is
    part of the upload it would time); in ``metrics/`` and the task's result when this attempt published."""
    publish_s: float | None = None
    """Asking the proxy to publish the version (compare-and-set); present where ``upload_s`` is."""


class StepRecord(_Stored):
    """What one optimizer step did, for people and dashboards.

    Hop: built by the optimize worker (``worker.optimize.job``) and written as ``step_record.json``
    into the new version's folder (covered by its manifest), then copied to
    ``runs/<run>/metrics/step-S.json`` once published. Read by the optimize worker's metrics (the in-memory
    record), and from ``metrics/`` by ``asyncgrpo status``, ``asyncgrpo plot`` and the demo. Never read for
    training. Means over no values (no rewards, no updates) are None.
    """

    run: str
    step: int
    """The optimize step; it produced version ``step``."""
    version: int
    base_version: int
    """The version the step started from (step - 1)."""
    worker_id: str
    """The optimize worker that trained it."""
    published_at: float
    """Unix time (seconds) the record was made, just before the upload."""
    samples: int
    groups: int
    tokens: int
    """Completion tokens trained on."""
    reward_mean: float | None
    reward_std: float | None
    """Population std over the step's completions."""
    rewards_by_name: dict[str, float | None]
    """Mean per reward function."""
    rewards_std_by_name: dict[str, float | None]
    completion_length_mean: float | None
    truncated_fraction: float
    """Share of completions cut at max_completion_length."""
    staleness: list[int]
    """Per rollout, in ``rollouts`` order: base_version minus the rollout's version (its oldest token's)."""
    max_staleness: int
    token_staleness_mean: float | None = Field(None, exclude_if=lambda value: value is None)
    """Over the model tokens trained on, base_version minus the version that sampled each one; below the
    rollouts' staleness where sequences followed newer versions while they were sampled
    (``async.inflight_versions = "follow"``). Absent from records written before it existed."""
    token_staleness_max: int | None = Field(None, exclude_if=lambda value: value is None)
    """The stalest model token trained on (the rollouts' ``max_staleness`` bounds it)."""
    masked_stale_tokens: int | None = Field(None, exclude_if=lambda value: value is None)
    """With ``async.stale_tokens = "mask"``: model tokens left out of the loss because their version fell out of
    the staleness window (the token figures above leave them out too); absent otherwise."""
    ratio: float | None
    """Mean over the updates of their ``UpdateMetrics`` figure; likewise kl ... lr below."""
    rescore_ratio: float | None
    """Mean of the rollouts' rescoring ratios (should be 1)."""
    rescored_sequences: int | None = Field(None, exclude_if=lambda value: value is None)
    """Sequences rescored in a separate forward (a seeded sample of each stale rollout, see
    ``loss.rescore_stale_fraction``). Absent from records written before it existed."""
    reused_sequences: int | None = Field(None, exclude_if=lambda value: value is None)
    """Fresh sequences whose ratio came from the training forward of the step's first update (no extra
    forward). Absent from records written before it existed."""
    importance_sampling_ratio: CorrectionFigures | None = Field(None, exclude_if=lambda value: value is None)
    """Over the step's updates, the generator-trainer correction's weights (``UpdateMetrics``); only when the
    step corrected a sample."""
    tools: ToolFigures | None = Field(None, exclude_if=lambda value: value is None)
    """[agent] runs: what the step's conversations did with their tools; absent otherwise."""
    kl: float | None
    entropy: float | None
    clip_low: float | None
    clip_high: float | None
    clip_region: float | None
    loss: float | None
    grad_norm: float | None
    lr: float | None
    updates: list[UpdateMetrics]
    rollouts: list[RolloutEntry]
    flagged_rollouts: list[FlaggedRollout]
    timings: StepTimings

    def staleness_per_sample(self) -> list[int]:
        """One staleness per completion trained on (a rollout of 32 samples counts 32 times)."""
        if len(self.staleness) != len(self.rollouts):
            return list(self.staleness)
        return [
            value for value, rollout in zip(self.staleness, self.rollouts, strict=True) for _ in range(rollout.samples)
        ]

    @property
    def forward_backward_s(self) -> float | None:
        """Forward and backward passes of the whole step: summed over its updates."""
        return sum(update.forward_backward_s for update in self.updates) if self.updates else None

    @property
    def optimizer_s(self) -> float | None:
        """Clipping and optimizer updates of the whole step: summed over its updates."""
        return sum(update.optimizer_s for update in self.updates) if self.updates else None


class EvalRecord(_Stored):
    """The evaluation of one version on the run's held-out prompts (``[eval]``).

    Hop: merged by the proxy from the chunk summaries its generate workers posted
    (``asyncgrpo.protocol.evals.merge_chunks``) and written to ``runs/<run>/evals/vNNNNNNNN.json``; read by
    ``asyncgrpo status``, ``asyncgrpo plot`` and trackers, which forward ``metrics`` as ``eval/<key>``. Never
    read for training.
    """

    run: str
    version: int
    evaluated_at: float
    """Unix time (seconds) the proxy merged the record."""
    prompts: int
    """Eval prompts scored (the failed ones are counted in ``metrics["prompts_failed"]``)."""
    samples_per_prompt: int
    temperature: float
    metrics: dict[str, float]
    """Flat, TRL-style names: ``reward``, ``reward_std``, ``rewards/<name>/mean``, ``pass@1``, ``pass@<k>``,
    ``completions/mean_length``, ``prompts_failed``."""
    examples: list[EvalExample] = Field(default_factory=list)
