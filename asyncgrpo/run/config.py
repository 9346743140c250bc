"""The run config: one pydantic model, loaded from TOML, every field documented and bounded.

It is validated once by ``asyncgrpo run create`` and stored as ``runs/<run>/config.json``; the proxy and
every worker read that stored copy, so all processes of a run agree on it.

The run config's ``[dataset]`` table: where prompts come from and how workers feed them to the model.

Its own module because the table is large; ``asyncgrpo.run.config`` re-exports ``DatasetConfig``, and the
``[eval.dataset]`` table reuses it.

The `[tracking]` table: which experiment trackers the proxy forwards step records and eval results to.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from asyncgrpo.run.agent_config import AgentConfig
from asyncgrpo.run.reward_config import BUILTIN_REWARD_NAMES as BUILTIN_REWARD_NAMES
from asyncgrpo.run.reward_config import REWARD_CHOICES as REWARD_CHOICES
from asyncgrpo.run.reward_config import REWARDS_NEEDING_ANSWER as REWARDS_NEEDING_ANSWER
from asyncgrpo.run.reward_config import RewardConfig, resolve_reward_folders


class TrackingConfig(BaseModel):
    # As every config section (config._Section): a misspelt field is an error, not an ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    report_to: list[Literal["trackio", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Experiment trackers the proxy forwards each published step record and each eval result to, "
        "under TRL's metric names: any of 'trackio', 'wandb', 'mlflow' (a list, or one name); [] or 'none': "
        "none. Each needs its extra (pip install 'asyncgrpo[trackio]'); credentials and servers come from the "
        "library's own environment variables. A failing tracker never stops the run.",
    )
    project: str = Field(
        "asyncgrpo",
        min_length=1,
        max_length=128,
        description="Tracker project: the trackio and wandb project, the mlflow experiment.",
    )
    run_name: str = Field(
        "",
        pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})?$",
        description="Name (and wandb id) of the tracker run: letters, digits, '.', '_', '-'; empty: the asyncgrpo "
        "run name. A restarted or stand-by proxy resumes this tracker run.",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _none_or_names(cls, value: object) -> object:
        # TRL's report_to takes one string or a list; "none" means no tracker. "all" (every installed
        # integration) is refused: which trackers a run reports to should not depend on what is installed.
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            if value == ["none"]:
                return []
            if "all" in value:
                raise ValueError("'all' is not accepted: list the trackers to report to ('trackio', 'wandb', 'mlflow')")
            duplicates = sorted({name for name in value if isinstance(name, str) and value.count(name) > 1})
            if duplicates:
                raise ValueError(f"trackers {duplicates} are listed more than once; list each once")
        return value


class DatasetConfig(BaseModel):
    """Where the prompts come from: exactly one of ``path``, ``hub_id`` or ``generator``. Loaded once, by
    ``run create``, and frozen into the run's ``prompts.jsonl``; workers never read the source."""

    # As every config section (config._Section): a misspelt field is an error, not an ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = Field(
        None,
        description="Prompt file (.jsonl, .json, .csv or .parquet), relative to the config file. Set only one of "
        "`path`, `hub_id`, `generator`.",
    )
    hub_id: str | None = Field(
        None,
        description="A Hugging Face Hub dataset id (e.g. 'openai/gsm8k'), or a local folder: one written by "
        "`save_to_disk`, or a folder of parquet/arrow/json/csv files. Loaded with the `datasets` library "
        "(pip install 'asyncgrpo[hub]').",
    )
    subset: str | None = Field(None, description="The dataset's config name on the Hub (e.g. 'main' for gsm8k).")
    split: str = Field("train", min_length=1, description="The split of `hub_id` to use.")
    revision: str | None = Field(
        None, description="Pin `hub_id` to this Hub commit, tag or branch (default: the latest)."
    )
    generator: str | None = Field(
        "repeat_digit",
        description="Name of a built-in prompt generator (e.g. 'repeat_digit'), used when neither `path` nor "
        "`hub_id` is set.",
    )
    num_prompts: int = Field(
        512, ge=1, le=10_000_000, description="How many prompts the generator makes (ignored with `path`/`hub_id`)."
    )
    max_rows: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Use only the first max_rows rows of `path` or of the `hub_id` split (default: all).",
    )
    prompt_column: str = Field("prompt", min_length=1, description="Column holding the prompt text.")
    answer_column: str | None = Field(
        "answer", description="Column holding the reference answer passed to rewards (may be empty)."
    )
    answer_pattern: str | None = Field(
        None,
        description="Regular expression that extracts the reference answer from the answer column: its first "
        "group (or the whole match), stripped; a row it does not match is an error. E.g. '####\\s*(.+)' for "
        "gsm8k's '... #### 42'.",
    )
    messages_column: str | None = Field(
        None,
        description="Column holding a chat, a list of {role, content}, used as the prompt instead of "
        "`prompt_column` with the tokenizer's chat template; trailing assistant turns (a reference reply) are "
        "dropped.",
    )
    chat_template: bool = Field(
        False,
        description="Wrap each prompt as one user message and apply the tokenizer's chat template with the "
        "generation prompt (for instruct models). The templated text is what rollouts record.",
    )
    system_prompt: str | None = Field(
        None,
        description="System message put before each chat when templating (not when the chat has its own). "
        "Needs `chat_template` or `messages_column`.",
    )
    environment_column: str | None = Field(
        None,
        description="Column naming each prompt's environment, when agent.environment is a table of named "
        "environments (TRL's `environment` field).",
    )

    @model_validator(mode="before")
    @classmethod
    def _generator_only_by_default(cls, data: object) -> object:
        # The generator applies only when no other source is named, so a config with `path` or `hub_id` need not
        # also write `generator = ""`; and runs stored before `hub_id` existed (their config.json spells the
        # default generator next to `path`) keep loading as they did.
        if isinstance(data, dict) and (data.get("path") or data.get("hub_id")):
            return {**data, "generator": None}
        return data

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            pattern = re.compile(value)
        except re.error as error:
            raise ValueError(f"{value!r} is not a valid regular expression: {error}") from None
        if pattern.groups > 1:
            raise ValueError(f"{value!r} has {pattern.groups} groups; use at most one, around the answer")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        sources = [name for name in ("path", "hub_id", "generator") if getattr(self, name)]
        if not sources:
            raise ValueError(
                "set dataset.path to a prompt file, dataset.hub_id to a Hub dataset (or a local dataset folder), "
                "or dataset.generator to a built-in generator"
            )
        if len(sources) > 1:
            named = " and ".join(f"dataset.{name}" for name in sources)
            raise ValueError(f"{named} are all set; set only one source of prompts")
        if self.system_prompt is not None and not self.chat_templated:
            raise ValueError(
                "dataset.system_prompt is only used with a chat template: set dataset.chat_template = true "
                "or dataset.messages_column"
            )
        hub_only = [name for name in ("subset", "revision") if getattr(self, name) is not None]
        if hub_only and not self.hub_id:
            raise ValueError(f"dataset.{hub_only[0]} applies to dataset.hub_id only; set hub_id or remove it")
        return self

    @property
    def chat_templated(self) -> bool:
        """Whether workers feed prompts through the tokenizer's chat template."""
        return self.chat_template or self.messages_column is not None


LossType = Literal["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class _Section(BaseModel):
    # A misspelt field is an error, not a silently ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    base: str = Field(
        "tiny",
        description="Base model: a Hugging Face hub id, a local directory in Hugging Face format, or "
        "'tiny' for the small random-init model that `asyncgrpo model tiny` builds (no download); 'tiny-agent' for "
        "its sibling with a tool-calling chat template (the toy agent task).",
        min_length=1,
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of the base weights. LoRA weights and optimizer state stay float32."
    )
    max_prompt_length: int = Field(
        256, ge=1, le=131072, description="Prompts longer than this many tokens are rejected as bad input."
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] | None = Field(
        None,
        description="Attention kernel of the base model in the trainer and the transformers generate backend "
        "(transformers' attn_implementation; TRL's model_init_kwargs): 'sdpa', 'eager', 'flash_attention_2' or "
        "'flash_attention_3'; unset: transformers' default. flash-attention needs its package (flash-attn; "
        "flash_attn_interface for 3) and a GPU. The padding-free trainer uses flash-attention's varlen kernel when "
        "it is chosen here; with sdpa (the default) it attends within each sequence's own slice of a packed row.",
    )


class LoraConfig(_Section):
    rank: int = Field(8, ge=1, le=512, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, le=4096, description="LoRA alpha; the update is scaled by alpha/r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout during the optimizer step.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt, or 'all-linear' for every linear layer except the output head.",
    )

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one module name, or 'all-linear'")
        return value


class SamplingConfig(_Section):
    samples_per_prompt: int = Field(
        8, ge=2, le=1024, description="G: completions per prompt; advantages are computed within a group."
    )
    max_completion_length: int = Field(
        16, ge=1, le=131072, description="Completions stop at EOS or after this many tokens."
    )
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; keep 1.0 for exact logprobs.")
    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="Default generation backend; a generate worker flag can override it."
    )


class OptimizerConfig(_Section):
    learning_rate: float = Field(2e-3, gt=0.0, le=1.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2.")
    max_grad_norm: float = Field(1.0, gt=0.0, le=1e6, description="Gradient clipping by global norm.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate decay after warmup, over `total_steps`."
    )
    warmup_steps: int = Field(0, ge=0, le=1_000_000, description="Linear warmup steps.")
    total_steps: int = Field(200, ge=1, le=10_000_000, description="Optimizer steps of the whole run.")
    micro_batch_tokens: int = Field(
        8192, ge=16, le=10_000_000, description="Token budget of one forward/backward micro-batch."
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward instead of keeping them (TRL's "
        "gradient_checkpointing; non-reentrant): less activation memory, about 30% more compute.",
    )
    torch_compile: bool = Field(
        False,
        description="Compile each decoder layer with torch.compile (TRL's torch_compile): faster steps once "
        "compiled; the first steps are slower while it compiles.",
    )
    padding_free: bool = Field(
        True,
        description="Pack completions into one row per micro-batch (position ids restart per sequence; attention "
        "stays inside each sequence): no padding tokens. Exact; False pads each micro-batch to its longest "
        "sequence.",
    )


class LossConfig(_Section):
    """``[loss]``: the GRPO objective. Field names and defaults are TRL's ``GRPOConfig``'s (``worker.algo.grpo``
    defines each option), except ``epsilon_high``, whose default here is DAPO's 0.28."""

    loss_type: LossType = Field(
        "dapo",
        description="dapo: token sum / tokens in the step; grpo: mean of per-sequence means; "
        "dr_grpo: token sum / (B * max_completion_length); bnpo: token mean per micro-batch; cispo: clipped "
        "importance weight (at most epsilon_high, no gradient) times advantage times logprob, token sum / tokens; "
        "sapo: soft sigmoid gate instead of the clip (sapo_temperature_*), grpo's aggregation; luspo: per-sequence "
        "token sums, mean over sequences; vespo: gamma-shaped sequence weight (vespo_*) times advantage times "
        "logprob, token sum / tokens.",
    )
    epsilon_low: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        validation_alias=AliasChoices("epsilon_low", "epsilon"),
        description="Lower PPO clip: ratio >= 1 - epsilon_low (TRL's `epsilon`, accepted as that name too).",
    )
    epsilon_high: float = Field(
        0.28,
        ge=0.0,
        le=100.0,
        description="Upper PPO clip: ratio <= 1 + epsilon_high; for cispo the cap of the importance weight "
        "(TRL recommends 5.0 there).",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="'token': one importance ratio per token; 'sequence': the exponential of the mean log ratio "
        "of each sequence, shared by its tokens (GSPO).",
    )
    delta: float | None = Field(
        None,
        gt=1.0,
        le=100.0,
        description="Two-sided clipping: the unclipped ratio is also capped at delta (> 1; e.g. 1 + 2 * "
        "epsilon_high), so a negative advantage cannot weigh without bound. Unset: off. The clipped loss types "
        "only.",
    )
    decoupled: bool = Field(
        False,
        description="Decoupled PPO (AReaL): clip the ratio to the proximal policy (the weights right before the "
        "update) instead of to the behaviour policy that sampled, and weigh each token by its behavior weight "
        "exp(proximal - behaviour) (no gradient), so a stale sample is corrected without its staleness eating "
        "the clip range. The clipped loss types only (dapo, grpo, dr_grpo, bnpo, luspo).",
    )
    behavior_weight_cap: float | None = Field(
        None,
        gt=1.0,
        le=100.0,
        description="With decoupled: a token whose behavior weight exceeds this leaves the policy term (weight 0; "
        "the normalisers still count it). Unset: no cap.",
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0.0, le=100.0, description="sapo: temperature of the gate on tokens with a positive advantage."
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0.0, le=100.0, description="sapo: temperature of the gate on tokens with a negative advantage."
    )
    vespo_k_pos: float = Field(2.0, ge=0.0, le=100.0, description="vespo: shape k of the weight, advantage >= 0.")
    vespo_lambda_pos: float = Field(3.0, gt=0.0, le=100.0, description="vespo: rate lambda, advantage >= 0.")
    vespo_k_neg: float = Field(3.0, ge=0.0, le=100.0, description="vespo: shape k of the weight, advantage < 0.")
    vespo_lambda_neg: float = Field(2.0, gt=0.0, le=100.0, description="vespo: rate lambda, advantage < 0.")
    off_policy_mask_threshold: float | None = Field(
        None,
        ge=0.0,
        le=100.0,
        description="Off-policy sequence mask (DeepSeek-V3.2): a sequence with a negative advantage whose mean "
        "log ratio of the generator's logprobs to the current policy's exceeds this is left out of the loss. "
        "Unset: off.",
    )
    top_entropy_quantile: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Train only on the tokens whose entropy is in this top share of each micro-batch's "
        "(0.2: the 20% most uncertain tokens); 1.0: every token.",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Leave completions cut at max_completion_length out of the loss (their group's advantages "
        "still count them).",
    )
    beta: float = Field(0.0, ge=0.0, le=100.0, description="Weight of the k3 KL to the base model (0: off).")
    use_bias_correction_kl: bool = Field(
        True,
        description="Multiply the per-token KL term by the importance ratio, so that samples of an older policy "
        "estimate the current policy's KL without bias (with beta > 0).",
    )
    scale_rewards: ScaleRewards = Field(
        "group",
        description="Divide advantages by the std of the rewards of their group ('group'), of the generate task's "
        "groups ('batch'), or not at all ('none', Dr. GRPO). true and false are read as 'group' and 'none'.",
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="With several rewards: weight and sum them, then normalise per group (scale_rewards); or "
        "normalise each reward per group, sum with the weights, then normalise the sum over the generate task "
        "(GDPO).",
    )
    vllm_importance_sampling_correction: bool | None = Field(
        None,
        description="Correct for the generator's logprobs differing from the trainer's (bf16, other kernels): "
        "every sequence is rescored under the version that generated it, those logprobs are the PPO "
        "denominator, and exp(trainer - generator) weighs the loss (vllm_importance_sampling_mode). Unset: on "
        "for rollouts of the vLLM backend, off for the transformers backend (whose logprobs are the trainer's "
        "own forward); true or false: for every rollout.",
    )
    vllm_importance_sampling_mode: ImportanceSamplingMode = Field(
        "sequence_mask",
        description="How the correction weight is formed: per token or per sequence (the product over its "
        "tokens), and kept inside [clip_min, clip_max] by truncating it there or by dropping (weight 0) what "
        "falls outside.",
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        None, ge=0.0, le=1e6, description="Lower bound of the correction weight (unset: none)."
    )
    vllm_importance_sampling_clip_max: float | None = Field(
        3.0, gt=0.0, le=1e6, description="Upper bound of the correction weight (unset: none)."
    )
    ratio_flag_tolerance: float = Field(
        0.05,
        gt=0.0,
        le=10.0,
        description="A rollout whose mean rescoring ratio is further than this from 1 is flagged, with "
        "the worker that made it.",
    )
    rescore_stale_fraction: float = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="Share of the sequences of each rollout rescored in a separate forward when the "
        "training forward cannot serve as its rescoring (stale rollouts; fresh ones when LoRA dropout > 0 or "
        "after the first update of a step with publish_every > 1); at least one sequence per rollout, a "
        "seeded random choice. 1.0 rescores every such sequence.",
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _bool_scale_rewards(cls, value: object) -> object:
        # Runs stored before the modes existed (and TRL) spell it as a bool.
        if isinstance(value, bool):
            return "group" if value else "none"
        return value

    @model_validator(mode="after")
    def _consistent(self) -> LossConfig:
        # The loss (worker.algo.grpo) checks the same at every call; here a run is refused before it starts.
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"loss.vllm_importance_sampling_clip_min={low} is not below loss.vllm_importance_sampling_clip_max="
                f"{high}; the correction weight would have no room"
            )
        if self.vllm_importance_sampling_mode.endswith("_truncate") and low is None and high is None:
            raise ValueError(
                f"loss.vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} truncates the weight: "
                "set loss.vllm_importance_sampling_clip_min or loss.vllm_importance_sampling_clip_max"
            )
        if self.decoupled and self.loss_type in ("cispo", "sapo", "vespo"):
            raise ValueError(
                f"loss.decoupled = true clips the ratio to the proximal policy, and loss.loss_type="
                f"{self.loss_type!r} has no clipped ratio: set loss.loss_type to dapo, grpo, dr_grpo, bnpo or luspo, "
                "or loss.decoupled = false"
            )
        if self.behavior_weight_cap is not None and not self.decoupled:
            raise ValueError(
                f"loss.behavior_weight_cap={self.behavior_weight_cap} caps the decoupled behavior weight, but "
                "loss.decoupled is false: set loss.decoupled = true, or unset loss.behavior_weight_cap"
            )
        if self.loss_type == "cispo" and self.epsilon_high == 0:
            raise ValueError("loss.loss_type='cispo' caps the weight at loss.epsilon_high: set it above 0 (TRL: 5.0)")
        if (
            self.loss_type == "vespo"
            and self.vllm_importance_sampling_correction is not False
            and self.vllm_importance_sampling_mode.startswith("sequence")
        ):
            raise ValueError(
                "loss.loss_type='vespo' folds the correction weight into its per-token sum: set "
                "loss.vllm_importance_sampling_mode to 'token_truncate' or 'token_mask' (or "
                "loss.vllm_importance_sampling_correction = false)"
            )
        return self


class AsyncConfig(_Section):
    groups_per_task: int = Field(4, ge=1, le=4096, description="Prompt groups in one generate task.")
    groups_per_step: int = Field(8, ge=1, le=65536, description="Prompt groups in one optimizer step.")
    max_staleness: int = Field(
        2,
        ge=0,
        le=64,
        description="A sample made with version N trains a step starting from version C only if "
        "C - N <= max_staleness.",
    )
    queue_maxsize: int = Field(
        16,
        ge=1,
        le=100_000,
        description="Buffer size, in groups: the proxy dispatches generate tasks while in-flight + "
        "buffered groups stay at or below this (or below the paced limit, see adaptive_inflight).",
    )
    adaptive_inflight: bool = Field(
        True,
        description="Size the groups kept in flight plus buffered from the measured trainer step time and "
        "generate task time, so rollouts arrive just before the trainer needs them (fresher samples when "
        "the trainer is the bottleneck); queue_maxsize stays the upper bound. false: always queue_maxsize.",
    )
    publish_every: int = Field(
        1, ge=1, le=1000, description="Optimizer steps per published version (1: publish every step)."
    )
    inflight_versions: Literal["keep", "follow"] = Field(
        "keep",
        description="keep: a generate task samples every token with the version it leased. follow: a worker that "
        "has loaded a newer version moves the sequences still decoding onto it between two decode steps (agent "
        "conversations between turns); each token records the version that sampled it and its logprob, and "
        "staleness is that of the rollout's oldest token. On the vLLM backend only agent conversations follow (between "
        "turns); its single-turn sampling keeps the leased version.",
    )
    stale_tokens: Literal["drop", "mask"] = Field(
        "drop",
        description="A rollout whose oldest tokens fell out of the staleness window (its sequences followed newer "
        "versions, inflight_versions = follow). drop: it is dropped as stale and its prompts requeued, as a "
        "rollout of one version is. mask: it is admitted and trained while its newest token is inside the window, "
        "its tokens older than the window masked out of the loss and counted (the step record's "
        "masked_stale_tokens). No token older than the window trains unmasked either way.",
    )
    partial_rollouts: bool = Field(
        True,
        description="A generate task saves its unfinished sequences (tokens so far, each one's logprob and "
        "version) to the bucket every partial_save_every_s seconds and when its worker is told to stop (SIGTERM), "
        "and the next task of the same prompt continues them from their token ids instead of sampling them "
        "again; a kill -9 loses only what was sampled since the last save. Saved tokens keep their own "
        "versions: their staleness is checked like a followed sequence's (stale_tokens). The transformers "
        "backend only (the vLLM backend samples every task afresh). false: nothing saved, an interrupted task "
        "samples again from nothing.",
    )
    partial_save_every_s: float = Field(
        10.0,
        gt=0.0,
        le=3600.0,
        description="Seconds between two saves of a generate task's unfinished sequences (partial_rollouts): "
        "what a kill -9 can lose at most. Each save is one small bucket write per prompt of the task.",
    )
    lease_ttl_s: float = Field(60.0, gt=0.0, le=86400.0, description="Seconds a lease lives unless renewed.")
    generate_task_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=86400.0,
        description="A generate task not submitted after this long is presumed lost; its prompts go back "
        "in line and a late submission is refused.",
    )
    max_group_attempts: int = Field(
        3,
        ge=1,
        le=1000,
        description="A prompt group whose generate task failed this many times in a row (timed out, its worker "
        "died, or its worker reported a failure) ends as rejected with the reason instead of going back in line.",
    )
    optimize_task_timeout_s: float = Field(
        1800.0, gt=0.0, le=86400.0, description="An optimize step not published after this long is re-sent."
    )
    max_step_attempts: int = Field(
        3,
        ge=1,
        le=100,
        description="A step whose optimize task fails this many times without naming a bad rollout (e.g. a "
        "non-finite gradient norm) has its whole batch rejected and is claimed again with a new batch.",
    )
    keep_every: int = Field(
        0, ge=0, le=1_000_000, description="Also keep every keep_every-th version forever (0: none)."
    )
    rollout_retention_versions: int = Field(
        2,
        ge=-1,
        le=1_000_000,
        description="Rollout objects in the bucket are deleted this many versions after they stop being "
        "needed: after the version their step produced if trained, after the current version when dropped "
        "as stale, rejected or cancelled. Buffered and claimed rollouts are never deleted. -1 keeps every "
        "rollout forever (for audits).",
    )

    @model_validator(mode="after")
    def _buffer_fits_a_step(self) -> AsyncConfig:
        if self.queue_maxsize < self.groups_per_task:
            raise ValueError(
                f"async.queue_maxsize={self.queue_maxsize} is smaller than async.groups_per_task="
                f"{self.groups_per_task}; raise queue_maxsize or lower groups_per_task"
            )
        # The buffer fills in whole generate tasks, so only a multiple of groups_per_task is reachable.
        needed = self.groups_per_step * self.publish_every
        reachable = (self.queue_maxsize // self.groups_per_task) * self.groups_per_task
        if needed > reachable:
            raise ValueError(
                f"a published version needs async.groups_per_step * async.publish_every = "
                f"{self.groups_per_step} * {self.publish_every} = {needed} groups, but the buffer holds at most "
                f"{reachable} (async.queue_maxsize={self.queue_maxsize} in tasks of async.groups_per_task="
                f"{self.groups_per_task}): no step could ever fill; raise queue_maxsize"
            )
        return self


EVAL_SEED_OFFSET = 1_000_003
"""Added to the run's seed for the eval prompts a generator makes, so they are not the training prompts."""


class EvalDatasetConfig(DatasetConfig):
    """The held-out prompts of ``[eval.dataset]``: the training set's fields, with fewer generated prompts."""

    num_prompts: int = Field(
        64, ge=1, le=10_000_000, description="How many eval prompts the generator makes (ignored with `path`)."
    )


def _each_reward_once(value: list[RewardConfig], field: str) -> list[RewardConfig]:
    names = [reward.name for reward in value]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{field} {duplicates} are listed more than once; list each once with its total weight")
    return value


class EvalConfig(_Section):
    """``[eval]``: evaluation of published versions on held-out prompts; it never feeds a gradient."""

    every_versions: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="0: no evaluation. K: evaluate versions 0, K, 2K, ... and always the final version, each "
        "once, on the held-out prompts of [eval.dataset]; results go to runs/<run>/evals/vNNNNNNNN.json.",
    )
    dataset: EvalDatasetConfig = Field(default_factory=EvalDatasetConfig)
    samples_per_prompt: int = Field(
        1, ge=1, le=1024, description="Completions per eval prompt; above 1, pass@k is reported for k = 1 and k = this."
    )
    temperature: float = Field(0.0, ge=0.0, le=10.0, description="Eval sampling temperature (0: greedy).")
    max_completion_length: int = Field(
        0, ge=0, le=131072, description="Eval completions stop after this many tokens (0: the sampling one)."
    )
    rewards: list[RewardConfig] = Field(
        default_factory=list,
        description="Rewards of the eval, summed with their weights (empty: the run's rewards); entries as in "
        "[[rewards]], reward models too.",
    )
    pass_threshold: float = Field(
        1.0, ge=-1e6, le=1e6, description="A completion is correct (pass@k) when its total reward is at least this."
    )
    examples: int = Field(4, ge=0, le=64, description="Example completions kept in each eval record.")
    max_prompts_per_task: int = Field(
        64, ge=1, le=4096, description="Eval prompts per eval task: a larger set is split over several workers."
    )

    @field_validator("rewards")
    @classmethod
    def _rewards_once(cls, value: list[RewardConfig]) -> list[RewardConfig]:
        return _each_reward_once(value, "eval.rewards")

    @model_validator(mode="after")
    def _greedy_samples_once(self) -> EvalConfig:
        if self.temperature == 0.0 and self.samples_per_prompt > 1:
            raise ValueError(
                f"eval.temperature = 0 is greedy: its eval.samples_per_prompt={self.samples_per_prompt} completions "
                "would all be the same; set eval.samples_per_prompt = 1, or a temperature above 0 for pass@k"
            )
        return self


class RunConfig(_Section):
    """A whole run. Sections map to TOML tables: ``[model]``, ``[lora]``, ``[dataset]``, ``[[rewards]]``,
    ``[sampling]``, ``[optimizer]``, ``[loss]``, ``[async]``, ``[eval]``, ``[tracking]``."""

    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of prompt order, LoRA init and sampling.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    rewards: list[RewardConfig] = Field(
        default_factory=lambda: [RewardConfig(name="repeat_digit")],
        description="Rewards summed with their weights (at least one, unless agent.environment owns the reward).",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    agent: AgentConfig | None = Field(
        None, description="Multi-turn rollouts with tools or environments (asyncgrpo.run.agent_config)."
    )

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("rewards")
    @classmethod
    def _each_reward_once(cls, value: list[RewardConfig]) -> list[RewardConfig]:
        return _each_reward_once(value, "rewards")

    @model_validator(mode="after")
    def _agent_fits(self) -> RunConfig:
        agent = self.agent
        if not self.rewards and (agent is None or agent.environment is None):
            raise ValueError("rewards: add at least one [[rewards]] entry (or an agent.environment with get_reward)")
        if agent is None:
            if self.dataset.environment_column is not None:
                raise ValueError("dataset.environment_column names environments, but [agent] has no environment table")
            return self
        if not agent.tools and agent.environment is None:
            raise ValueError("[agent] has neither tools nor environment; set agent.tools or agent.environment")
        if not self.dataset.chat_templated:
            raise ValueError(
                "[agent] conversations go through the tokenizer's chat template: set dataset.chat_template = true "
                "or dataset.messages_column"
            )
        if agent.named_environments != (self.dataset.environment_column is not None):
            raise ValueError(
                "agent.environment is a table of named environments: set dataset.environment_column to the column "
                "naming each prompt's environment"
                if agent.named_environments
                else "dataset.environment_column is set, but agent.environment is not a table of named environments"
            )
        if self.eval.every_versions:
            if not self.eval.dataset.chat_templated:
                raise ValueError("[agent] evaluates conversations too: set eval.dataset.chat_template = true")
            if agent.named_environments and self.eval.dataset.environment_column is None:
                raise ValueError("agent.environment is a table: set eval.dataset.environment_column as well")
        return self

    @property
    def final_version(self) -> int:
        """The last version of the run: one version per ``publish_every`` optimizer steps."""
        return -(-self.optimizer.total_steps // self.async_.publish_every)

    def to_json(self) -> str:
        data = self.model_dump(mode="json", by_alias=True)
        data["rewards"] = [reward.stored() for reward in self.rewards]
        data["eval"]["rewards"] = [reward.stored() for reward in self.eval.rewards]
        # Runs without [agent] store the bytes they stored before it existed.
        if data["agent"] is None:
            del data["agent"]
        if data["dataset"]["environment_column"] is None:
            del data["dataset"]["environment_column"]
        if data["eval"]["dataset"]["environment_column"] is None:
            del data["eval"]["dataset"]["environment_column"]
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        return cls.model_validate_json(text)


class ConfigError(ValueError):
    """A config that cannot be used; the message names each field and what to change."""


def describe_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"{source} is not a valid run config:"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        field = field.replace("async_", "async")
        lines.append(f"  - {field}: {item['msg']}")
    return "\n".join(lines)


def parse_run_config(data: dict, source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, source)) from error


def load_run_config(path: str | Path) -> RunConfig:
    """Read and validate a TOML run config; raise ConfigError naming the bad field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"config file {path} does not exist") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from error
    return parse_run_config(resolve_reward_folders(data, path.parent), str(path))
