"""The optimize job with real parts (tiny model, PEFT adapters, FileBucket, real rollouts) and a recording
stand-in for the proxy: the ratio check flags a worker serving the wrong weights, staleness is checked again
where the gradient is made, and a redelivered step is a no-op."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from proxy.protocol.errors import Conflict
from proxy.protocol.schemas import GroupRef, PublishRequest, RolloutRef
from proxy.protocol.staleness import StaleRolloutError
from proxy.run.config import RunConfig
from proxy.storage import bucket_keys
from proxy.storage.bucket import Bucket, open_bucket
from proxy.storage.manifest import fetch_version, sha256_hex, write_version
from worker.algo.grpo import group_advantages
from worker.algo.rollout import Rollout, RolloutSample, encode_rollout
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import Policy
from worker.optimize.job import run_optimize_step
from worker.optimize.trainer import Trainer

RUN = "opt-job"
G = 4


@dataclass
class RecordingProxy:
    """Stands in for ProxyClient: the current version, and the publishes it was asked for."""

    current_version: int
    published: list[PublishRequest] = field(default_factory=list)

    def run_info(self) -> Any:
        return self

    def publish(self, request: PublishRequest) -> None:
        self.published.append(request)
        self.current_version = request.version


def config() -> RunConfig:
    return RunConfig.model_validate(
        {"sampling": {"samples_per_prompt": G, "max_completion_length": 8}, "async": {"max_staleness": 1}}
    )


@pytest.fixture
def setup(tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None) -> tuple[Trainer, Bucket, Path]:
    cfg = config()
    trainer = Trainer.initial(Policy.load(str(tiny_model_dir)), cfg)
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    write_version(bucket, RUN, 0, trainer.version_files(0), {"step": 0, "base_version": -1})
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


def make_rollout(
    bucket: Bucket, backend: TransformersBackend, adapter: str, task_id: str, worker_id: str, version: int
) -> RolloutRef:
    result = backend.generate(
        ["3=", "5="], adapter=adapter, samples_per_prompt=G, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=7
    )
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
    data = encode_rollout(Rollout(RUN, task_id, version, worker_id, groups, samples))
    key = bucket_keys.rollout_key(RUN, task_id)
    bucket.put(key, data)
    return RolloutRef(
        task_id=task_id, key=key, sha256=sha256_hex(data), version=version, group_ids=[g.group_id for g in groups]
    )


def test_rollout_from_wrong_weights_is_flagged_with_its_worker(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer, bucket, adapter_dir = setup
    backend = TransformersBackend(str(tiny_model_dir))
    backend.load_adapter("v0", 0, adapter_dir)
    backend.load_adapter("impostor", 0, wrong_weights(adapter_dir, tmp_path / "wrong"))
    good = make_rollout(bucket, backend, "v0", "t-good", "gen-good", 0)
    bad = make_rollout(bucket, backend, "impostor", "t-bad", "gen-bad", 0)
    proxy = RecordingProxy(current_version=0)

    result = run_optimize_step(
        run=RUN, step=1, base_version=0, rollout_refs=[good, bad], config=config(), trainer=trainer,
        bucket=bucket, client=proxy, worker_id="opt-1",
    )

    assert result.status == "published" and proxy.published[0].version == 1
    assert result.record is not None
    flagged = result.record.flagged_rollouts
    assert [(f.task_id, f.worker_id) for f in flagged] == [("t-bad", "gen-bad")]
    ratios = {r.task_id: r.ratio for r in result.record.rollouts}
    assert abs(ratios["t-good"] - 1) < 1e-4 and abs(ratios["t-bad"] - 1) > config().loss.ratio_flag_tolerance


def test_too_stale_rollout_never_reaches_a_gradient(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path
) -> None:
    trainer, bucket, adapter_dir = setup
    backend = TransformersBackend(str(tiny_model_dir))
    backend.load_adapter("v0", 0, adapter_dir)
    stale = make_rollout(bucket, backend, "v0", "t-old", "gen-1", 0)
    for version in (1, 2):  # versions 1 and 2 exist; a step from 2 may use samples of 1 or 2 only
        metadata = {"step": version, "base_version": version - 1}
        write_version(bucket, RUN, version, trainer.version_files(version), metadata)
    proxy = RecordingProxy(current_version=2)
    before = [p.detach().clone() for p in trainer.lora_parameters]

    with pytest.raises(StaleRolloutError, match="max_staleness=1"):
        run_optimize_step(
            run=RUN, step=3, base_version=2, rollout_refs=[stale], config=config(), trainer=trainer,
            bucket=bucket, client=proxy, worker_id="opt-1",
        )
    assert proxy.published == [] and bucket.head(bucket_keys.manifest_key(RUN, 3)) is None
    assert all((p == b).all() for p, b in zip(trainer.lora_parameters, before, strict=True))


def test_redelivered_step_that_is_published_is_a_no_op(setup: tuple[Trainer, Bucket, Path]) -> None:
    # Version 1 is published and already collected (no files, no step record): nothing to do, no error.
    trainer, bucket, _ = setup
    proxy = RecordingProxy(current_version=1)
    result = run_optimize_step(
        run=RUN, step=1, base_version=0, rollout_refs=[], config=config(), trainer=trainer,
        bucket=bucket, client=proxy, worker_id="opt-2",
    )
    assert result.status == "already_published" and proxy.published == []


@dataclass
class ProxyThatAdoptedOurUpload(RecordingProxy):
    """A rebuilt proxy that already adopted the uploaded version from the bucket: the publish is a conflict."""

    def publish(self, request: PublishRequest) -> None:
        self.current_version = request.version
        raise Conflict("409 conflict: the current version is already v1")


def test_conflict_on_our_own_adopted_upload_still_records_the_step(
    setup: tuple[Trainer, Bucket, Path], tiny_model_dir: Path
) -> None:
    trainer, bucket, adapter_dir = setup
    backend = TransformersBackend(str(tiny_model_dir))
    backend.load_adapter("v0", 0, adapter_dir)
    ref = make_rollout(bucket, backend, "v0", "t-1", "gen-1", 0)
    proxy = ProxyThatAdoptedOurUpload(current_version=0)

    result = run_optimize_step(
        run=RUN, step=1, base_version=0, rollout_refs=[ref], config=config(), trainer=trainer,
        bucket=bucket, client=proxy, worker_id="opt-1",
    )
    assert result.status == "published" and trainer.version == 1
    assert bucket.head(bucket_keys.metrics_key(RUN, 1)) is not None, "the step record must reach metrics/"
    # The returned record is the stored one, plus the upload time only this attempt measured.
    assert result.record is not None and result.record.step == 1 and result.record.timings.upload_s is not None
