"""The optimize job with real parts (tiny model, PEFT adapters, FileBucket, real rollouts) and a recording
stand-in for the proxy: the ratio check flags a worker serving the wrong weights, staleness is checked again
where the gradient is made, and a redelivered step is a no-op."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.bucket.layout import IntegrityError, fetch_version, read_manifest, sha256_hex, write_version
from asyncgrpo.protocol.errors import Conflict, NotFound
from asyncgrpo.protocol.records import RolloutExtra, StepRecord
from asyncgrpo.protocol.schemas import (
    CorruptResult,
    GroupRef,
    OptimizeTaskMessage,
    PublishRequest,
    RepairTaskMessage,
    RolloutRef,
    StaleRolloutError,
    StepStartRequest,
    VersionInfo,
)
from asyncgrpo.run.config import RunConfig
from worker.algo.advantages import group_advantages
from worker.algo.rollout import Rollout, RolloutSample, decode_rollout, encode_rollout
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import Policy
from worker.optimize import rescore
from worker.optimize.batch import build_train_samples
from worker.optimize.job import Optimizer
from worker.optimize.trainer import Trainer
from worker.optimize.trainer_state import VERSION_FILE_NAMES as ADAPTER_VERSION_FILES

RUN = "opt-job"
G = 4


@dataclass
class RecordingProxy:
    """Stands in for ProxyClient: the current version, and the publishes it was asked for."""

    current_version: int
    published: list[PublishRequest] = field(default_factory=list)
    versions: dict[int, str] = field(default_factory=dict)  # the manifest sha "recorded" at each publish
    reports: list[tuple[int, str]] = field(default_factory=list)  # corruption reports: (version, key)
    started: list[tuple[int, StepStartRequest]] = field(default_factory=list)

    def run_info(self) -> Any:
        return self

    def start_step(self, step: int, request: StepStartRequest) -> None:
        self.started.append((step, request))

    def publish(self, request: PublishRequest) -> None:
        self.published.append(request)
        self.versions[request.version] = request.manifest_sha256
        self.current_version = request.version

    def version_info(self, version: int) -> VersionInfo:
        if version not in self.versions:
            if version != 0:
                raise NotFound(f"version {version} was never published")
            self.versions[0] = V0_SHA[0]  # the setup fixture's version 0, as if published
        return VersionInfo(version=version, manifest_sha256=self.versions[version])

    def report_corrupt(self, version: int, worker_id: str, key: str) -> CorruptResult:
        self.reports.append((version, key))
        return CorruptResult(action="repair_sent", holder="opt-1")


V0_SHA: list[str] = []


def config() -> RunConfig:
    return RunConfig.model_validate(
        {"sampling": {"samples_per_prompt": G, "max_completion_length": 8}, "async": {"max_staleness": 1}}
    )


@pytest.fixture
def setup(tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None) -> tuple[Trainer, Bucket, Path]:
    cfg = config()
    trainer = Trainer.initial(Policy.load(str(tiny_model_dir)), cfg)
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    _, sha = write_version(bucket, RUN, 0, trainer.version_files(0), {"step": 0, "base_version": -1})
    V0_SHA[:] = [sha]
    adapter_dir = tmp_path / "v0"
    fetch_version(bucket, RUN, 0, adapter_dir)
    return trainer, bucket, adapter_dir


def wrong_weights(adapter_dir: Path, out: Path) -> Path:
    """The same adapter with its B matrices (zero at init) set to noise: another policy."""
    out.mkdir()
    config_name = bucket_keys.ADAPTER_CONFIG_NAME
    (out / config_name).write_bytes((adapter_dir / config_name).read_bytes())
    tensors = load_file(str(adapter_dir / bucket_keys.ADAPTER_WEIGHTS_NAME))
    noise = torch.Generator().manual_seed(0)
    for key, value in tensors.items():
        if "lora_B" in key:
            tensors[key] = torch.empty_like(value).uniform_(-0.5, 0.5, generator=noise)
    save_file(tensors, str(out / bucket_keys.ADAPTER_WEIGHTS_NAME))
    return out


def backend_at_v0(tiny_model_dir: Path, adapter_dir: Path) -> TransformersBackend:
    """A generate backend holding version 0's adapter, to make the rollouts a step trains on."""
    backend = TransformersBackend(str(tiny_model_dir))
    backend.load_adapter("v0", 0, adapter_dir)
    return backend


def make_rollout(
    bucket: Bucket,
    backend: TransformersBackend,
    adapter: str,
    task_id: str,
    worker_id: str,
    version: int,
    *,
    noise: float = 0.0,
    sampler: str | None = None,
) -> RolloutRef:
    """A rollout of 2 groups of G; ``noise``: the std of seeded noise added to its behaviour logprobs (a
    generator whose numerics differ from the trainer's); ``sampler``: the backend it claims."""
    result = backend.generate(
        ["3=", "5="], adapter=adapter, samples_per_prompt=G, max_completion_length=8, temperature=1.0, top_p=1.0, seed=7
    )
    perturb = torch.Generator().manual_seed(11)
    for prompt_result in result.results:
        for completion in prompt_result.completions:
            shift = noise * torch.randn(len(completion.logprobs), generator=perturb)
            completion.logprobs = (torch.tensor(completion.logprobs) + shift).tolist()
    rewards = [random.Random(i).random() for i in range(2 * G)]
    advantages = group_advantages(rewards, G).tolist()
    samples = [
        RolloutSample(
            group_index=g,
            prompt_token_ids=result.results[g].prompt_token_ids,
            completion_token_ids=c.token_ids,
            behavior_logprobs=c.logprobs,
            reward=rewards[g * G + i],
            advantage=advantages[g * G + i],
            finish_reason=c.finish_reason,
        )
        for g in range(2)
        for i, c in enumerate(result.results[g].completions)
    ]
    groups = [GroupRef(group_id=f"{task_id}.{g}", prompt_index=g) for g in range(2)]
    extra = RolloutExtra(sampler=sampler)
    data = encode_rollout(Rollout(RUN, task_id, version, worker_id, groups, samples, extra=extra))
    key = bucket_keys.rollout_key(RUN, task_id)
    bucket.put(key, data)
    return RolloutRef(
        task_id=task_id, key=key, sha256=sha256_hex(data), version=version, group_ids=[g.group_id for g in groups]
    )


def test_rollout_from_wrong_weights_is_flagged_with_its_worker(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer, bucket, adapter_dir = setup
    backend = backend_at_v0(tiny_model_dir, adapter_dir)
    backend.load_adapter("impostor", 0, wrong_weights(adapter_dir, tmp_path / "wrong"))
    good = make_rollout(bucket, backend, "v0", "t-good", "gen-good", 0)
    bad = make_rollout(bucket, backend, "impostor", "t-bad", "gen-bad", 0)
    proxy = RecordingProxy(current_version=0)

    result = Optimizer(RUN, config(), trainer, bucket, proxy, "opt-1").step(1, 0, [good, bad])

    assert result.status == "published" and proxy.published[0].version == 1
    assert result.record is not None
    flagged = result.record.flagged_rollouts
    assert [(f.task_id, f.worker_id) for f in flagged] == [("t-bad", "gen-bad")]
    ratios = {r.task_id: r.ratio for r in result.record.rollouts}
    assert abs(ratios["t-good"] - 1) < 1e-4 and abs(ratios["t-bad"] - 1) > config().loss.ratio_flag_tolerance


def test_too_stale_rollout_never_reaches_a_gradient(setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path) -> None:
    trainer, bucket, adapter_dir = setup
    backend = backend_at_v0(tiny_model_dir, adapter_dir)
    stale = make_rollout(bucket, backend, "v0", "t-old", "gen-1", 0)
    for version in (1, 2):  # versions 1 and 2 exist; a step from 2 may use samples of 1 or 2 only
        metadata = {"step": version, "base_version": version - 1}
        write_version(bucket, RUN, version, trainer.version_files(version), metadata)
    proxy = RecordingProxy(current_version=2)
    before = [p.detach().clone() for p in trainer.lora_parameters]

    with pytest.raises(StaleRolloutError, match="max_staleness=1"):
        Optimizer(RUN, config(), trainer, bucket, proxy, "opt-1").step(3, 2, [stale])
    assert proxy.published == [] and bucket.head(bucket_keys.manifest_key(RUN, 3)) is None
    assert all((p == b).all() for p, b in zip(trainer.lora_parameters, before, strict=True))


@pytest.mark.parametrize("stale_tokens", ["drop", "mask"])
def test_tokens_older_than_the_window_never_train_unmasked(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path, stale_tokens: str
) -> None:
    """Leased at v0, its sequences followed v2 after their second token; step 3 from v2 (max_staleness 1): the
    v0 tokens are out of the window. Dropped by default; with async.stale_tokens = "mask" trained on its v2
    tokens alone, the v0 ones masked and counted (a sequence that ended before the switch is v0's whole)."""
    trainer, bucket, adapter_dir = setup
    backend = backend_at_v0(tiny_model_dir, adapter_dir)
    ref = make_rollout(bucket, backend, "v0", "t-followed", "gen-1", 0)
    rollout = decode_rollout(bucket.get(ref.key))
    for sample in rollout.samples:
        length = len(sample.completion_token_ids)
        sample.token_versions = [0, 0, *[2] * (length - 2)] if length > 2 else None
    assert rollout.newest_version() == 2
    data = encode_rollout(rollout)
    bucket.put(ref.key, data)
    ref = ref.model_copy(update={"sha256": sha256_hex(data)})
    for version in (1, 2):  # the same weights as v0's: the rollout's logprobs are every version's
        metadata = {"step": version, "base_version": version - 1}
        write_version(bucket, RUN, version, trainer.version_files(version), metadata)
    cfg = RunConfig.model_validate(
        {**config().model_dump(by_alias=True), "async": {"max_staleness": 1, "stale_tokens": stale_tokens}}
    )
    optimizer = Optimizer(RUN, cfg, trainer, bucket, RecordingProxy(current_version=2), "opt-1")
    if stale_tokens == "drop":
        with pytest.raises(StaleRolloutError, match="rollout v0 is 2 versions behind v2"):
            optimizer.step(3, 2, [ref])
        return
    result = optimizer.step(3, 2, [ref])
    assert result.status == "published" and result.record is not None
    old = sum(min(2, len(s.completion_token_ids)) for s in rollout.samples)
    fresh = sum(max(0, len(s.completion_token_ids) - 2) for s in rollout.samples)
    assert old > 0 and fresh > 0
    assert result.record.masked_stale_tokens == old
    assert result.record.updates[0].tokens == fresh, "only the v2 tokens train"
    assert (result.record.token_staleness_mean, result.record.token_staleness_max) == (0.0, 0)
    assert result.record.staleness == [2], "the rollout's own staleness is its oldest token's"
    # What the trainer built: no token older than the window in any loss mask.
    samples, _ = build_train_samples([rollout], cfg.loss, oldest_trained=1)
    for sample in samples:
        versions = sample.token_versions or [0] * len(sample.completion_token_ids)
        assert not any(model and v < 1 for model, v in zip(sample.model_flags(), versions, strict=True))


def test_redelivered_step_that_is_published_is_a_no_op(setup: tuple[Trainer, Bucket, Path]) -> None:
    # Version 1 is published and already collected (no files, no step record): nothing to do, no error.
    trainer, bucket, _ = setup
    proxy = RecordingProxy(current_version=1)
    result = Optimizer(RUN, config(), trainer, bucket, proxy, "opt-2").step(1, 0, [])
    assert result.status == "already_published" and proxy.published == []


@dataclass
class ProxyThatAdoptedOurUpload(RecordingProxy):
    """A rebuilt proxy that already adopted the uploaded version from the bucket: the publish is a conflict."""

    def publish(self, request: PublishRequest) -> None:
        self.current_version = request.version
        self.versions[request.version] = request.manifest_sha256
        raise Conflict("409 conflict: the current version is already v1")


def test_conflict_on_our_own_adopted_upload_still_records_the_step(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path
) -> None:
    trainer, bucket, adapter_dir = setup
    backend = backend_at_v0(tiny_model_dir, adapter_dir)
    ref = make_rollout(bucket, backend, "v0", "t-1", "gen-1", 0)
    proxy = ProxyThatAdoptedOurUpload(current_version=0)

    result = Optimizer(RUN, config(), trainer, bucket, proxy, "opt-1").step(1, 0, [ref])
    assert result.status == "published" and trainer.version == 1
    # The returned record is the stored one, plus the upload time only this attempt measured.
    assert result.record is not None and result.record.step == 1 and result.record.timings.upload_s is not None


def test_wrong_weights_are_flagged_fresh_and_stale_with_default_rescoring(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Step 3 from version 2 trains on fresh (v2) rollouts and on rollouts two (v0, read from the bucket) and
    # one (v1, kept in memory when this trainer wrote it) versions stale: a good one and an impostor of each.
    # Fresh ones are checked by the training forward, a sample of each stale one under its version's weights.
    trainer, bucket, v0_dir = setup
    cfg = RunConfig.model_validate({**config().model_dump(by_alias=True), "async": {"max_staleness": 2}})
    backend = TransformersBackend(str(tiny_model_dir))
    backend.load_adapter("v0", 0, v0_dir)
    backend.load_adapter("impostor", 0, wrong_weights(v0_dir, tmp_path / "wrong"))
    refs = [
        make_rollout(bucket, backend, "v0", "t-v0-good", "gen-a", 0),
        make_rollout(bucket, backend, "impostor", "t-v0-bad", "gen-b", 0),
    ]
    optimizer = Optimizer(RUN, cfg, trainer, bucket, RecordingProxy(current_version=0), "opt-1")
    assert optimizer.recent.versions(RUN) == []  # v0 must come from the bucket, as on a fresh worker
    for step in (1, 2):  # each version differs from the last, so rescoring under the wrong one would drift
        version_dir = tmp_path / f"v{step}"
        optimizer.client = RecordingProxy(current_version=step - 1)
        published = optimizer.step(step, step - 1, refs[:1])
        assert published.status == "published"
        fetch_version(bucket, RUN, step, version_dir)
        backend.load_adapter(f"v{step}", step, version_dir)
        refs += [
            make_rollout(bucket, backend, f"v{step}", f"t-v{step}-good", "gen-a", step),
            make_rollout(bucket, backend, "impostor", f"t-v{step}-bad", "gen-b", step),
        ]
    assert optimizer.recent.versions(RUN) == [0, 1, 2]  # v1 and v2 kept when written, v0 when read for step 2
    optimizer.recent.forget(RUN, 0)

    optimizer.client = RecordingProxy(current_version=2)
    result = optimizer.step(3, 2, refs)

    record = result.record
    assert record is not None and result.status == "published"
    assert sorted(f.task_id for f in record.flagged_rollouts) == ["t-v0-bad", "t-v1-bad", "t-v2-bad"]
    ratios = {r.task_id: r.ratio for r in record.rollouts}
    assert all(abs(ratios[f"t-v{v}-good"] - 1) < 1e-4 for v in (0, 1, 2))
    # Default fraction 0.25 of 8 sequences: two per stale rollout; the 16 fresh ones reuse the training forward.
    assert (record.rescored_sequences, record.reused_sequences) == (8, 16)
    assert record.timings.rescore_s is not None


def test_rescoring_everything_and_dropout_fall_back_to_separate_forwards(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    _, bucket, v0_dir = setup
    backend = TransformersBackend(str(tiny_model_dir))
    backend.load_adapter("impostor", 0, wrong_weights(v0_dir, tmp_path / "wrong"))
    backend.load_adapter("v0", 0, v0_dir)
    refs = [
        make_rollout(bucket, backend, "v0", "t-good", "gen-a", 0),
        make_rollout(bucket, backend, "impostor", "t-bad", "gen-b", 0),
    ]
    # LoRA dropout makes the training forward differ from an eval one: fresh samples are rescored apart.
    # 1.0 rescores every sequence that needs a separate forward; fresh ones without dropout never do.
    cases = (
        ({"lora": {"dropout": 0.1}}, 4, 0),
        ({"lora": {"dropout": 0.1}, "loss": {"rescore_stale_fraction": 1.0}}, 16, 0),
        ({"loss": {"rescore_stale_fraction": 1.0}}, 0, 16),
    )
    for overrides, rescored, reused in cases:
        cfg = RunConfig.model_validate({**config().model_dump(by_alias=True), **overrides})
        trainer = Trainer.initial(Policy.load(str(tiny_model_dir)), cfg)
        trainer.load_version_files({name: (v0_dir / name).read_bytes() for name in ADAPTER_VERSION_FILES})
        run_bucket = open_bucket(f"file://{tmp_path / f'b{rescored}-{reused}'}")
        for ref in refs:
            run_bucket.put(ref.key, bucket.get(ref.key))
        result = Optimizer(RUN, cfg, trainer, run_bucket, RecordingProxy(current_version=0), "opt-1").step(1, 0, refs)
        assert result.record is not None
        assert [f.task_id for f in result.record.flagged_rollouts] == ["t-bad"]
        assert (result.record.rescored_sequences, result.record.reused_sequences) == (rescored, reused)


def test_a_published_step_writes_metrics_from_memory_without_rereading(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path
) -> None:
    trainer, bucket, adapter_dir = setup
    backend = backend_at_v0(tiny_model_dir, adapter_dir)
    ref = make_rollout(bucket, backend, "v0", "t-1", "gen-1", 0)
    reads: list[str] = []
    plain_get = bucket.get
    bucket.get = lambda key: reads.append(key) or plain_get(key)  # type: ignore[method-assign]

    result = Optimizer(RUN, config(), trainer, bucket, RecordingProxy(current_version=0), "opt-1").step(1, 0, [ref])

    # The probe for an earlier upload of the step (absent), the rollout, write_version's own create-only probe;
    # nothing read back after publishing (manifest and record used to be re-read to copy the record).
    manifest = bucket_keys.manifest_key(RUN, 1)
    assert reads == [manifest, ref.key, manifest]
    # metrics/ is the proxy's to write (it copies the published manifest's record before answering).
    assert bucket.head(bucket_keys.metrics_key(RUN, 1)) is None
    assert result.record is not None
    timings = result.record.timings
    assert None not in (timings.fetch_s, timings.rescore_s, timings.serialize_s, timings.upload_s, timings.publish_s)
    manifest, _ = read_manifest(bucket, RUN, 1)
    in_version = StepRecord.model_validate_json(plain_get(manifest.file_key(RUN, "step_record.json")))
    assert in_version.timings.upload_s is None
    assert in_version.model_dump(exclude={"timings"}) == result.record.model_dump(exclude={"timings"})


def test_rescoring_plan_checks_every_rollout_and_reuses_only_the_first_update(
    setup: tuple[Trainer, Bucket, Path],
) -> None:
    trainer = setup[0]
    groups = [GroupRef(group_id="g", prompt_index=0)]
    sample = RolloutSample(0, [1], [2, 3], [-1.0, -1.0], 0.0, 0.0, "length")
    rollouts = [Rollout(RUN, f"t{i}", version, "gen", groups, [sample] * 10) for i, version in enumerate((5, 5, 4, 3))]
    owners = [owner for owner in range(4) for _ in range(10)]

    def plan(seed: int, fraction: float = 0.25) -> rescore.RescorePlan:
        # publish_every > 1: the first update trains only the first 15 samples, half of rollout 1 included.
        return rescore.plan_rescoring(
            trainer, rollouts, owners, base_version=5, first_update=range(15), fraction=fraction, seed=seed
        )

    first = plan(seed=1)
    assert first.reused == list(range(15))
    # The rest of fresh rollout 1 needs the base weights before the update: rescored apart, like the stale ones.
    assert {version: len(indices) for version, indices in first.separate.items()} == {5: 2, 4: 3, 3: 3}
    assert all(10 <= i < 20 for i in first.separate[5]) and all(20 <= i < 30 for i in first.separate[4])
    assert plan(seed=1) == first and plan(seed=2) != first, "the sample is seeded by the step"
    assert plan(seed=1, fraction=1e-6).rescored == 3, "at least one sequence per rollout"
    assert plan(seed=1, fraction=1.0).rescored == 25


def test_rescoring_under_an_older_version_is_pinned_to_the_sha_the_proxy_published(
    setup: tuple[Trainer, Bucket, Path],
) -> None:
    """The bucket's manifest of version 0 is not the one the proxy recorded (another attempt's, or replaced):
    its weights are never used to rescore."""
    trainer, bucket, _ = setup
    recent = rescore.RecentAdapterWeights()  # nothing kept: version 0 is read from the bucket
    sample = RolloutSample(0, [1], [2, 3], [-1.0, -1.0], 0.0, 0.0, "length")
    stale = Rollout(RUN, "t0", 0, "gen", [GroupRef(group_id="g", prompt_index=0)], [sample])
    plan = rescore.RescorePlan(separate={0: [0]})
    train_samples, _ = build_train_samples([stale])
    with pytest.raises(IntegrityError, match="not the one the proxy published"):
        rescore.rescore_planned(
            trainer,
            bucket,
            RUN,
            1,
            [stale],
            train_samples,
            plan,
            recorded_sha=lambda version: "0" * 64,
            recent=recent,
        )
    assert recent.versions(RUN) == []  # weights that failed the check are never kept
    scored = rescore.rescore_planned(
        trainer,
        bucket,
        RUN,
        1,
        [stale],
        train_samples,
        plan,
        recorded_sha=lambda version: V0_SHA[0],
        recent=recent,
    )
    assert list(scored) == [0] and recent.versions(RUN) == [0]


def test_corrected_rollouts_are_rescored_whole_under_their_own_version_and_weighted(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Step 3 from version 2, the correction at its default (on for the vLLM sampler's rollouts only): a noisy
    # "vLLM" rollout two versions stale, an exact one a version stale and a fresh one, and a transformers one
    # two versions stale.
    trainer, bucket, v0_dir = setup
    cfg = RunConfig.model_validate({**config().model_dump(by_alias=True), "async": {"max_staleness": 2}})
    assert cfg.loss.vllm_importance_sampling_correction is None
    backend = TransformersBackend(str(tiny_model_dir))
    backend.load_adapter("v0", 0, v0_dir)
    noisy = make_rollout(bucket, backend, "v0", "t-v0-vllm", "gen-v", 0, noise=0.3, sampler="vllm")
    plain = make_rollout(bucket, backend, "v0", "t-v0-hf", "gen-t", 0, sampler="transformers")
    refs = [noisy, plain]
    optimizer = Optimizer(RUN, cfg, trainer, bucket, RecordingProxy(current_version=0), "opt-1")
    for step in (1, 2):
        optimizer.client = RecordingProxy(current_version=step - 1)
        published = optimizer.step(step, step - 1, [plain])
        assert published.status == "published"
        fetch_version(bucket, RUN, step, tmp_path / f"v{step}")
        backend.load_adapter(f"v{step}", step, tmp_path / f"v{step}")
        refs.append(make_rollout(bucket, backend, f"v{step}", f"t-v{step}-vllm", "gen-v", step, sampler="vllm"))

    # What the step will rescore: every sequence of the stale vLLM rollouts, per token, under the weights that
    # sampled it (the exact one's equal its generator's logprobs), and a quarter of the transformers one.
    rollouts = [decode_rollout(bucket.get(ref.key)) for ref in refs]
    samples, keys = build_train_samples(rollouts, cfg.loss)
    owners = [owner for owner, _ in keys]
    plan = rescore.plan_rescoring(
        trainer,
        rollouts,
        owners,
        base_version=2,
        first_update=range(len(samples)),
        fraction=0.25,
        seed=0,
        samples=samples,
    )
    rescore.rescore_planned(trainer, bucket, RUN, 2, rollouts, samples, plan, recent=optimizer.recent)
    by_task = {rollouts[owner].task_id: [] for owner in owners}
    for sample, owner in zip(samples, owners, strict=True):
        by_task[rollouts[owner].task_id].append(sample)
    assert all(s.corrected and s.old_logprobs is None for s in by_task["t-v2-vllm"])  # the training forward's
    assert all(not s.corrected and s.old_logprobs is None for s in by_task["t-v0-hf"])
    for sample in by_task["t-v1-vllm"]:
        assert sample.old_logprobs == pytest.approx(sample.behavior_logprobs, abs=1e-4)
    assert all(s.corrected and s.old_logprobs is not None for s in by_task["t-v0-vllm"])
    gaps = [
        abs(o - b) for s in by_task["t-v0-vllm"] for o, b in zip(s.old_logprobs or [], s.behavior_logprobs, strict=True)
    ]
    assert sum(gaps) / len(gaps) == pytest.approx(0.3 * (2 / math.pi) ** 0.5, rel=0.35)

    optimizer.client = RecordingProxy(current_version=2)
    result = optimizer.step(3, 2, refs)
    record = result.record
    assert record is not None and result.status == "published"
    assert (record.rescored_sequences, record.reused_sequences) == (2 * 2 * G + 2, 2 * G)
    figures = record.importance_sampling_ratio
    assert figures is not None and figures.min < 1.0 < figures.max <= cfg.loss.vllm_importance_sampling_clip_max
    assert figures.logp_difference_max > 0.3
    # The correction weighs the noisy rollout; the rescoring check still names it (its ratio is not 1).
    assert [f.task_id for f in record.flagged_rollouts] == ["t-v0-vllm"]
    manifest, _ = read_manifest(bucket, RUN, 3)
    stored = StepRecord.model_validate_json(bucket.get(manifest.file_key(RUN, bucket_keys.STEP_RECORD_NAME)))
    assert stored.importance_sampling_ratio == figures


def test_two_optimizers_keep_their_own_held_version_and_weights(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path
) -> None:
    # What used to be module globals (the held version, the rescoring weights) is each optimizer's own: one that
    # trained a step holds it and can repair it; another in the same process holds nothing.
    trainer, bucket, adapter_dir = setup
    backend = backend_at_v0(tiny_model_dir, adapter_dir)
    ref = make_rollout(bucket, backend, "v0", "t-1", "gen-1", 0)
    proxy = RecordingProxy(current_version=0)
    first = Optimizer(RUN, config(), trainer, bucket, proxy, "opt-1")
    other = Optimizer(RUN, config(), trainer, bucket, RecordingProxy(current_version=1), "opt-2")

    message = OptimizeTaskMessage(run=RUN, step=1, base_version=0, rollouts=[ref])
    assert first.run_task(message).status == "published"
    assert (first.held.version, first.recent.versions(RUN)) == (1, [1])
    assert (other.held.version, other.recent.versions(RUN)) == (None, [])
    repair = RepairTaskMessage(
        run=RUN, version=1, key=bucket_keys.manifest_key(RUN, 1), manifest_sha256=proxy.versions[1]
    )
    assert other.repair(repair) == "not_held"
    assert first.repair(repair) == "repaired"
    # Step 0 goes to the init path: already published here, so nothing is written.
    init = OptimizeTaskMessage(run=RUN, step=0, base_version=-1)
    assert other.run_task(init).status == "already_published"
