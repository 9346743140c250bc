"""``asyncgrpo plot`` writes a PNG from step records; ``asyncgrpo export`` writes an adapter PEFT loads whole."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from peft import PeftModel, get_peft_model, load_peft_weights, set_peft_model_state_dict

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.bucket.layout import IntegrityError, write_version
from asyncgrpo.protocol.records import StepRecord, StepTimings, UpdateMetrics
from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.creation import create_run
from cli.export import ADAPTER_FILES, ExportError, export_version
from cli.main import main
from cli.plot import PlotError, plot_run
from worker.algo.rollout import Rollout, RolloutSample
from worker.model.policy import Policy, peft_lora_config
from worker.optimize.job import build_step_record
from worker.optimize.trainer import Trainer

RUN = "export-run"
CONFIG_TOML = """
seed = 3
[model]
base = "tiny"
[lora]
rank = 4
alpha = 8.0
[dataset]
generator = "repeat_digit"
num_prompts = 16
"""


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cache = tmp_path_factory.mktemp("asyncgrpo-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ASYNCGRPO_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def published(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Bucket, Trainer]:
    """A run with version 1 published by a real trainer whose LoRA B weights are non-zero."""
    root = tmp_path_factory.mktemp("export")
    config_path = root / "run.toml"
    config_path.write_text(CONFIG_TOML)
    bucket = open_bucket(f"file://{root / 'bucket'}")
    create_run(config_path, RUN, bucket)
    from asyncgrpo.run.creation import load_run

    config, _, _ = load_run(bucket, RUN)
    trainer = Trainer.initial(Policy.load(config.model.base, device="cpu"), config)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:  # B starts at zero; make the adapter change the model
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    write_version(bucket, RUN, 1, trainer.version_files(1), {"step": 1, "base_version": 0, "worker_id": "t-1"})
    return bucket, trainer


def _lora_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def test_exported_adapter_loads_with_every_key_and_the_trained_values(published, tmp_path: Path) -> None:
    bucket, trainer = published
    out = tmp_path / "adapter"
    result = export_version(bucket, RUN, "latest", out)
    assert result.version == 1
    assert sorted(p.name for p in out.iterdir()) == sorted([*ADAPTER_FILES, "asyncgrpo_export.json"])
    assert json.loads((out / "asyncgrpo_export.json").read_text())["adapter_name"] == "v1"

    # Load into a freshly wrapped model with a different init: every LoRA key must be in the file.
    fresh = Policy.load("tiny", device="cpu")
    with torch.random.fork_rng():
        torch.manual_seed(999)
        target = get_peft_model(fresh.model, peft_lora_config(trainer.lora_cfg))
    load = set_peft_model_state_dict(target, load_peft_weights(str(out)))
    assert not [key for key in load.missing_keys if "lora_" in key]
    assert not load.unexpected_keys

    # And PeftModel.from_pretrained, the documented path, gives the trained weights exactly.
    loaded = PeftModel.from_pretrained(Policy.load("tiny", device="cpu").model, str(out))
    expected = _lora_state(trainer.model)
    got = _lora_state(loaded)
    assert got.keys() == expected.keys() and expected
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_merged_model_matches_the_adapter(published, tmp_path: Path) -> None:
    bucket, _ = published
    out = tmp_path / "export"
    runner = CliRunner()
    answer = runner.invoke(
        main,
        ["export", "--run", RUN, "--bucket", bucket.url, "--version", "1", "--out", str(out), "--merge"],
    )
    assert answer.exit_code == 0, answer.output
    merged_dir = out / "merged"
    assert (merged_dir / "config.json").is_file() and (merged_dir / "tokenizer.json").is_file()
    assert not (merged_dir / bucket_keys.ADAPTER_CONFIG_NAME).exists()

    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    base = Policy.load("tiny", device="cpu")
    adapted = PeftModel.from_pretrained(base.model, str(out)).eval()
    ids = torch.tensor([base.encode_prompts(["3=", "7="])[0]])
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        plain = Policy.load("tiny", device="cpu").model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-3), "the adapter should change the model"


def test_corrupted_adapter_is_refused_and_nothing_is_written(published, tmp_path: Path) -> None:
    bucket, trainer = published
    files = trainer.version_files(2)
    manifest, _ = write_version(bucket, RUN, 2, files, {"step": 2, "base_version": 1, "worker_id": "t-1"})
    key = manifest.file_key(RUN, bucket_keys.ADAPTER_WEIGHTS_NAME)
    bucket.delete(key)
    bucket.put(key, files[bucket_keys.ADAPTER_WEIGHTS_NAME][:-8] + b"corrupt!")
    out = tmp_path / "bad"
    with pytest.raises(IntegrityError, match=re.escape(key)):
        export_version(bucket, RUN, 2, out)
    assert not out.exists()


def test_bad_export_requests_say_what_to_change(published, tmp_path: Path) -> None:
    bucket, _ = published
    with pytest.raises(ExportError, match=r"version 99 .* is not in"):
        export_version(bucket, RUN, 99, tmp_path / "a")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export_version(bucket, RUN, 1, busy)
    with pytest.raises(ExportError, match="neither a number nor 'latest'"):
        export_version(bucket, RUN, "newest", tmp_path / "b")


def _record(step: int, reward: float, stale: int) -> StepRecord:
    samples = [
        RolloutSample(
            0,
            [1, 2],
            [3] * (4 + step % 3),
            [-0.3] * (4 + step % 3),
            reward + 0.1 * i,
            0.0,
            "stop",
            {"repeat_digit": reward + 0.1 * i},
        )
        for i in range(4)
    ]
    rollout = Rollout(
        RUN, f"t{step}", step - 1 - stale, "gen-1", [GroupRef(group_id=f"g{step}", prompt_index=0)], samples
    )
    update = UpdateMetrics(
        update=step - 1,
        loss=0.1,
        ratio=1.0 + 0.01 * (step % 2),
        kl=0.001 * step,
        clip_low=0.0,
        clip_high=0.01,
        clip_region=0.01,
        entropy=1.0,
        grad_norm=0.5,
        lr=1e-3,
        tokens=16,
        sequences=4,
        micro_batches=1,
        forward_backward_s=0.3,
        optimizer_s=0.02,
    )
    record = build_step_record(
        run=RUN,
        step=step,
        base_version=step - 1,
        worker_id="trainer-1",
        rollouts=[rollout],
        ratios=[1.0],
        flagged=[],
        updates=[update],
        timings=StepTimings(step_s=0.5 + 0.05 * step, fetch_s=0.01),
    )
    record.published_at = 1_700_000_000.0 + 2.0 * step
    return record


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_of_the_run(tmp_path: Path) -> None:
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    with pytest.raises(PlotError, match="no step records"):
        plot_run(bucket, RUN, tmp_path / "empty.png")
    for step in range(1, 13):
        record = _record(step, reward=step / 12, stale=min(step % 3, step - 1))
        bucket.put(bucket_keys.metrics_key(RUN, step), record.model_dump_json().encode())
    bucket.put(bucket_keys.metrics_key(RUN, 13), b"{not json")  # skipped, not fatal

    out = tmp_path / "plots" / "run.png"
    answer = CliRunner().invoke(main, ["plot", "--run", RUN, "--bucket", bucket.url, "--out", str(out)])
    assert answer.exit_code == 0, answer.output
    width, height = _png_size(out)
    assert (width, height) == (1200, 800)
    assert out.stat().st_size > 20_000  # four panels of curves, not a blank canvas
