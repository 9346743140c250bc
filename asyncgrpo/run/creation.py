"""``asyncgrpo run create``: validate a run config and store it, with its prompts, in the bucket.

A run exists once ``runs/<run>/RUN_MANIFEST.json`` exists. ``create_run`` writes ``config.json`` and
``prompts/prompts.jsonl`` first (create-only) and the run manifest last, so a reader never sees a run
without its config and prompts. It never overwrites: creating the same run again with an identical config
and prompts is a no-op; anything else is refused with ``RunExistsError``.

``load_run`` is how the proxy and the workers read a run back: every object is checked against the sha256
in the run manifest before it is parsed. A run with ``[eval]`` also has ``prompts/eval_prompts.jsonl``, the
held-out prompts, written before the manifest like the others and read back with ``load_eval_prompts``.
"""

from __future__ import annotations

import importlib
import re
import time
from pathlib import Path

import structlog
from pydantic import ValidationError

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectExists, ObjectNotFound
from asyncgrpo.bucket.layout import FileDigest, IntegrityError, RunManifest, read_verified, sha256_hex
from asyncgrpo.run.config import (
    BUILTIN_REWARD_NAMES,
    EVAL_SEED_OFFSET,
    REWARD_CHOICES,
    REWARDS_NEEDING_ANSWER,
    ConfigError,
    RewardConfig,
    RunConfig,
    load_run_config,
)
from asyncgrpo.run.datasets import PromptRecord, build_dataset, dump_prompts_jsonl, parse_prompts_jsonl

log = structlog.get_logger()

# "org/name" as on the Hugging Face hub (one slash, no path-like start).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

__all__ = ["RunExistsError", "RunManifest", "RunNotFound", "create_run", "load_eval_prompts", "load_run"]


class RunExistsError(Exception):
    """The run name is taken by a run with another config or other prompts."""


class RunNotFound(ObjectNotFound):
    """No run of that name in the bucket (no RUN_MANIFEST.json)."""


def check_model_base(base: str) -> None:
    """Refuse a ``model.base`` that is neither 'tiny', an existing local folder, nor a hub id."""
    if base in ("tiny", "tiny-agent") or Path(base).expanduser().exists():
        return
    if _HUB_ID.match(base):
        return
    raise ConfigError(
        f"model.base={base!r} is not 'tiny', not an existing local directory, and does not look like a "
        "Hugging Face hub id (org/name); fix the path or the id"
    )


def check_rewards(
    config: RunConfig, prompts: list[PromptRecord], rewards: list[RewardConfig] | None = None, where: str = ""
) -> None:
    """Refuse, before anything is stored, a reward the generate workers could not use: a
    ``module:function`` that does not import here (workers import it the same way, from their Python path),
    or a reward that scores against reference answers when the dataset has none. ``rewards`` and ``where``
    (the config table, e.g. ``"eval."``): another reward list than the run's, checked against its prompts."""
    has_answers = any(record["answer"] is not None for record in prompts)
    for index, reward in enumerate(config.rewards if rewards is None else rewards):
        if reward.model is not None:
            check_reward_model_source(reward, f"{where}rewards.{index}")
            continue
        field = f"{where}rewards.{index}.name={reward.name!r}"
        if reward.name in REWARDS_NEEDING_ANSWER and not has_answers:
            raise ConfigError(
                f"{field} scores against a reference answer, but no prompt has one; set {where}dataset.answer_column "
                "to the column holding the answers, or use another reward"
            )
        if reward.name in BUILTIN_REWARD_NAMES:
            continue
        module_name, _, function_name = reward.name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # a user module may fail with anything at import time
            raise ConfigError(
                f"{field}: cannot import module {module_name!r} ({type(error).__name__}: {error}); fix the name, "
                "or make the module importable (install it, or put its folder on PYTHONPATH) here and on every "
                f"generate worker; or use {REWARD_CHOICES}"
            ) from error
        if not callable(getattr(module, function_name, None)):
            raise ConfigError(
                f"{field}: module {module_name!r} has no function {function_name!r}; fix the name, or use "
                f"{REWARD_CHOICES}"
            )


def check_reward_model_source(reward: RewardConfig, where: str) -> None:
    """Refuse a reward model (and tokenizer) that is neither an existing local folder nor spelt as a Hub id. Whether
    it loads is checked by the command line (``worker.model.reward_models.check_reward_models``), which may import
    transformers; this package may not (the proxy imports it)."""
    for key, value in (("model", reward.model), ("tokenizer", reward.tokenizer)):
        if value is None or Path(value).is_dir():
            continue
        if Path(value).is_absolute() or not _HUB_ID.match(value):
            raise ConfigError(
                f"{where}.{key}={value!r} (reward {reward.name!r}) is not an existing folder and does not look like a "
                "Hugging Face Hub id (org/name); fix the path (a relative folder is read from the config file's "
                "folder) or the id"
            )


def _digest(data: bytes) -> FileDigest:
    return FileDigest(sha256=sha256_hex(data), size=len(data))


def _put_once(bucket: Bucket, key: str, data: bytes, run: str) -> None:
    """Create-only write; an identical object already there (an earlier, interrupted create) is fine."""
    try:
        bucket.put(key, data, if_absent=True)
    except ObjectExists:
        if bucket.get(key) != data:
            raise RunExistsError(
                f"run {run!r} is partly created in {bucket.url} with a different {key.rsplit('/', 1)[-1]} "
                f"(no run manifest yet: another `run create` may be running); nothing was overwritten. "
                f"Pick another --run name, or delete {bucket_keys.run_prefix(run)} if that run is abandoned"
            ) from None


def _refuse_or_accept_existing(bucket: Bucket, run: str, wanted: RunManifest) -> bool:
    """True if the run already exists with this config and prompts; RunExistsError if with others."""
    key = bucket_keys.run_manifest_key(run)
    try:
        data = bucket.get(key)
    except ObjectNotFound:
        return False
    try:
        existing = RunManifest.model_validate_json(data)
    except ValidationError as error:
        raise IntegrityError(f"run manifest {key!r} is not valid: {error}", key=key) from error
    differs = [
        name
        for name, mine, theirs in (
            ("config", wanted.config, existing.config),
            ("prompts", wanted.prompts, existing.prompts),
            ("eval prompts", wanted.eval_prompts, existing.eval_prompts),
        )
        if (mine.sha256 if mine else None) != (theirs.sha256 if theirs else None)
    ]
    if differs:
        raise RunExistsError(
            f"run {run!r} already exists in {bucket.url} with a different {' and '.join(differs)}; "
            "nothing was overwritten. Pick another --run name for this config"
        )
    return True


def create_run(config_path: Path, run_name: str, bucket: Bucket) -> str:
    """Validate the config at ``config_path`` and store the run; return a one-paragraph summary."""
    config_path = Path(config_path)
    bucket_keys.check_run_name(run_name)
    config = load_run_config(config_path)
    check_model_base(config.model.base)
    prompts = build_dataset(config.dataset, config.seed, base_dir=config_path.parent)
    check_rewards(config, prompts)
    check_environment_names(config, prompts)
    eval_bytes = _eval_prompts_bytes(config, config_path.parent)

    config_bytes = config.to_json().encode()
    prompts_bytes = dump_prompts_jsonl(prompts)
    manifest = RunManifest(
        config=_digest(config_bytes),
        prompts=_digest(prompts_bytes),
        num_prompts=len(prompts),
        created_at=time.time(),
        eval_prompts=_digest(eval_bytes) if eval_bytes is not None else None,
        num_eval_prompts=len(parse_prompts_jsonl(eval_bytes)) if eval_bytes is not None else 0,
    )
    if _refuse_or_accept_existing(bucket, run_name, manifest):
        return (
            f"Run {run_name!r} already exists in {bucket.url} with this identical config and "
            f"{len(prompts)} prompts; nothing changed."
        )

    _put_once(bucket, bucket_keys.config_key(run_name), config_bytes, run_name)
    _put_once(bucket, bucket_keys.prompts_key(run_name), prompts_bytes, run_name)
    if eval_bytes is not None:
        _put_once(bucket, bucket_keys.eval_prompts_key(run_name), eval_bytes, run_name)
    try:
        bucket.put(bucket_keys.run_manifest_key(run_name), manifest.to_bytes(), if_absent=True)
    except ObjectExists:
        # A concurrent identical create won the race: fine; a different one: refuse.
        _refuse_or_accept_existing(bucket, run_name, manifest)
    log.info("run.created", run=run_name, bucket=bucket.url, num_prompts=len(prompts))
    return _summary(run_name, bucket, config, manifest)


def _eval_prompts_bytes(config: RunConfig, base_dir: Path) -> bytes | None:
    """The held-out prompts of ``[eval]`` (generated with another seed than the training ones), their rewards
    checked like the run's; None when evaluation is off."""
    if config.eval.every_versions == 0:
        return None
    prompts = build_dataset(config.eval.dataset, config.seed + EVAL_SEED_OFFSET, base_dir=base_dir)
    check_rewards(config, prompts, list(config.eval.rewards) or list(config.rewards), where="eval.")
    check_environment_names(config, prompts, where="eval.")
    return dump_prompts_jsonl(prompts)


def check_environment_names(config: RunConfig, prompts: list[PromptRecord], where: str = "") -> None:
    """Refuse prompts that name an environment [agent] does not have (named environments only)."""
    if config.agent is None or not config.agent.named_environments:
        return
    known = set(config.agent.environments)
    for index, record in enumerate(prompts):
        name = record.get("environment")
        if name not in known:
            raise ConfigError(
                f"{where}dataset.environment_column: prompt {index} names environment {name!r}, which "
                f"agent.environment does not have ({', '.join(sorted(str(k) for k in known))}); add it to the "
                "table or fix the prompt"
            )


def _summary(run: str, bucket: Bucket, config: RunConfig, manifest: RunManifest) -> str:
    dataset = config.dataset
    if dataset.hub_id:
        subset = f" subset {dataset.subset!r}" if dataset.subset else ""
        source = f"from {dataset.hub_id}{subset} split {dataset.split!r}"
    elif dataset.path:
        source = f"from {dataset.path}"
    else:
        source = f"from the built-in generator {dataset.generator!r}"
    if dataset.chat_templated:
        source += " (fed through the model's chat template)"
    rewards = ", ".join(f"{reward.name}×{reward.weight:g}" for reward in config.rewards)
    return (
        f"Created run {run!r} in {bucket.url}: {manifest.num_prompts} prompts {source} "
        f"(prompts sha256 {manifest.prompts.sha256[:12]}), base model {config.model.base!r} with LoRA rank "
        f"{config.lora.rank}, {config.sampling.samples_per_prompt} samples per prompt, rewards {rewards}, "
        f"{config.async_.groups_per_step} groups per step, max staleness {config.async_.max_staleness}, "
        f"{config.optimizer.total_steps} optimizer steps (config sha256 {manifest.config.sha256[:12]}). "
        f"Next: start the coordinator with `asyncgrpo proxy --run {run}` and workers with "
        "`asyncgrpo worker generate` / `asyncgrpo worker optimize`."
    )


def load_run(bucket: Bucket, run: str) -> tuple[RunConfig, list[PromptRecord], RunManifest]:
    """Read a run's config and prompts, each verified against ``RUN_MANIFEST.json`` before it is parsed."""
    manifest_key = bucket_keys.run_manifest_key(run)
    try:
        data = bucket.get(manifest_key)
    except ObjectNotFound:
        raise RunNotFound(
            f"run {run!r} does not exist in {bucket.url} (no {manifest_key}); create it with "
            f"`asyncgrpo run create CONFIG.toml --run {run}`"
        ) from None
    try:
        manifest = RunManifest.model_validate_json(data)
    except ValidationError as error:
        raise IntegrityError(f"run manifest {manifest_key!r} is not valid: {error}", key=manifest_key) from error

    config_key = bucket_keys.config_key(run)
    config_bytes = read_verified(bucket, config_key, manifest.config.sha256)
    try:
        config = RunConfig.from_json(config_bytes)
    except ValidationError as error:
        # The bytes are the ones create_run wrote, so this is a version skew between writer and reader.
        raise ConfigError(
            f"{config_key} does not validate with this asyncgrpo version: {error}; "
            "run the same asyncgrpo version that created the run"
        ) from error

    prompts_key = bucket_keys.prompts_key(run)
    prompts = parse_prompts_jsonl(read_verified(bucket, prompts_key, manifest.prompts.sha256), prompts_key)
    if len(prompts) != manifest.num_prompts:
        raise IntegrityError(
            f"{prompts_key!r} holds {len(prompts)} prompts but the run manifest says {manifest.num_prompts}",
            key=prompts_key,
        )
    return config, prompts, manifest


def load_eval_prompts(bucket: Bucket, run: str, manifest: RunManifest) -> list[PromptRecord]:
    """The run's held-out eval prompts, verified against the run manifest; [] for a run without evaluation."""
    if manifest.eval_prompts is None:
        return []
    key = bucket_keys.eval_prompts_key(run)
    prompts = parse_prompts_jsonl(read_verified(bucket, key, manifest.eval_prompts.sha256), key)
    if len(prompts) != manifest.num_eval_prompts:
        raise IntegrityError(
            f"{key!r} holds {len(prompts)} prompts but the run manifest says {manifest.num_eval_prompts}", key=key
        )
    return prompts
