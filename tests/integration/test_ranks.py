"""An optimize worker over 2 ranks (``worker.optimize.ranks``; real gloo ranks on CPU under
``torch.distributed.run``, the frozen base sharded with FSDP2): it computes the update one rank computes, and
version files written by 2 ranks resume on 1 and back on 2 with the same next updates."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_tensors

from asyncgrpo.bucket.layout import ADAPTER_WEIGHTS_NAME, TRAINER_STATE_TENSORS_NAME
from asyncgrpo.run.config import RunConfig
from tests.support import ranks_plan
from tests.support.train_samples import synthetic_samples
from worker.model.policy import Policy
from worker.optimize.trainer import Trainer

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.processes]

TOLERANCE = 1e-5
RANKS_PLAN = Path(ranks_plan.__file__)


def _config(**optimizer: Any) -> RunConfig:
    # A small token budget, so a step has several micro-batches to share out between the ranks.
    return RunConfig.model_validate(
        {"optimizer": {"micro_batch_tokens": 48, **optimizer}, "loss": {"beta": 0.05}, "sampling": {"temperature": 0.9}}
    )


def _trainer(model: Path, config: RunConfig) -> Trainer:
    return Trainer.initial(Policy.load(str(model)), config)


def _plan(model: Path, config: RunConfig, samples: list[Any], ops: list[list[Any]]) -> dict[str, Any]:
    return {
        "model": str(model),
        "config": config.model_dump_json(by_alias=True),
        "samples": [dataclasses.asdict(sample) for sample in samples],
        "ops": ops,
    }


def _on_two_ranks(plan: dict[str, Any], path: Path) -> list[Any]:
    path.write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(RANKS_PLAN)]
    done = subprocess.run([*argv, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    answer = json.loads(path.with_suffix(".results.json").read_text())
    assert answer["world"] == 2
    return answer["results"]


def _on_one_rank(plan: dict[str, Any], model: Path, config: RunConfig) -> list[Any]:
    # Through JSON, as the 2-rank results come back (tuples become lists).
    return json.loads(json.dumps(ranks_plan.run_plan(plan, _trainer(model, config))))


def _base_version(model: Path, config: RunConfig, folder: Path) -> list[Any]:
    """Version files off the LoRA init (LoRA B = 0 would hide a wrong swap), and samples to train on."""
    trainer = _trainer(model, config)
    samples = synthetic_samples(trainer, 24, seed=5)
    trainer.step(samples)
    folder.mkdir(parents=True)
    for name, data in trainer.version_files(1).items():
        (folder / name).write_bytes(data)
    return samples


def _close(mine: Any, theirs: Any, where: str = "") -> None:
    """Equal within TOLERANCE: numbers, and lists / dicts of them."""
    if isinstance(mine, dict):
        assert mine.keys() == theirs.keys(), where
        for key in mine:
            _close(mine[key], theirs[key], f"{where}.{key}")
    elif isinstance(mine, list):
        assert len(mine) == len(theirs), where
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            _close(a, b, f"{where}[{index}]")
    elif isinstance(mine, float) or isinstance(theirs, float):
        assert mine is not None and theirs is not None, where
        assert abs(mine - theirs) <= TOLERANCE * max(1.0, abs(mine)), (where, mine, theirs)
    else:
        assert mine == theirs, (where, mine, theirs)


def _state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a version: the adapter and the optimizer moments (RNG states left out)."""
    tensors = load_tensors((folder / ADAPTER_WEIGHTS_NAME).read_bytes())
    state = load_tensors((folder / TRAINER_STATE_TENSORS_NAME).read_bytes())
    tensors.update({name: value for name, value in state.items() if not name.startswith("rng/")})
    return tensors


def _states_close(mine: Path, theirs: Path) -> None:
    a, b = _state(mine), _state(theirs)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name  # full tensors: nothing of a rank's shard only
        gap = (a[name].float() - b[name].float()).abs().max().item()
        assert gap <= TOLERANCE, (name, gap)


def _timings_out(results: list[Any]) -> list[Any]:
    for result in results:
        if isinstance(result, dict) and "metrics" in result:
            result["metrics"].pop("forward_backward_s")
            result["metrics"].pop("optimizer_s")
    return results


@pytest.mark.parametrize(
    ("padding_free", "loss_type"), [(True, "dapo"), (False, "bnpo")], ids=["padding-free-dapo", "padded-bnpo"]
)
def test_two_ranks_compute_what_one_rank_computes(
    tiny_model_dir: Path, tmp_path: Path, padding_free: bool, loss_type: str
) -> None:
    config = _config(padding_free=padding_free).model_copy(
        update={"loss": _config().loss.model_copy(update={"loss_type": loss_type})}
    )
    samples = _base_version(tiny_model_dir, config, tmp_path / "base")
    ops = [
        ["load", str(tmp_path / "base")],
        ["rescore_under", str(tmp_path / "base")],  # the first forward of a call: rescoring, not training
        ["step"],
        ["rescore"],
        ["step"],
        ["rescore_under", str(tmp_path / "base")],
    ]
    one = _plan(tiny_model_dir, config, samples, [*ops, ["save", str(tmp_path / "one"), 3]])
    two = _plan(tiny_model_dir, config, samples, [*ops, ["save", str(tmp_path / "two"), 3]])
    expected = _timings_out(_on_one_rank(one, tiny_model_dir, config))
    got = _timings_out(_on_two_ranks(two, tmp_path / "plan.json"))
    assert got[2]["metrics"]["micro_batches"] > 2  # there was something to share out
    _close(got, expected)
    _states_close(tmp_path / "two", tmp_path / "one")


def test_resume_across_2_then_1_then_2_ranks_takes_the_never_stopped_updates(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = _config()
    samples = _base_version(tiny_model_dir, config, tmp_path / "base")
    base = str(tmp_path / "base")
    # Never stopped, one rank: three updates from the base.
    never = [["load", base], *[op for n in (2, 3, 4) for op in (["step"], ["save", str(tmp_path / f"never-{n}"), n])]]
    _on_one_rank(_plan(tiny_model_dir, config, samples, never), tiny_model_dir, config)
    # 2 ranks, then 1, then 2, each resuming from the version files the previous one wrote.
    _on_two_ranks(
        _plan(tiny_model_dir, config, samples, [["load", base], ["step"], ["save", str(tmp_path / "v2"), 2]]),
        tmp_path / "first.json",
    )
    _states_close(tmp_path / "v2", tmp_path / "never-2")
    one = [["load", str(tmp_path / "v2")], ["step"], ["save", str(tmp_path / "v3"), 3]]
    _on_one_rank(_plan(tiny_model_dir, config, samples, one), tiny_model_dir, config)
    _states_close(tmp_path / "v3", tmp_path / "never-3")
    last = [["load", str(tmp_path / "v3")], ["step"], ["save", str(tmp_path / "v4"), 4]]
    _on_two_ranks(_plan(tiny_model_dir, config, samples, last), tmp_path / "last.json")
    _states_close(tmp_path / "v4", tmp_path / "never-4")
    # What 2 ranks wrote is their whole state: loaded into one rank and written again, the very same bytes.
    reloaded = _trainer(tiny_model_dir, config)
    reloaded.load_version_files(ranks_plan.read_files(str(tmp_path / "v4")))
    again = reloaded.version_files(4)
    for name in (ADAPTER_WEIGHTS_NAME, TRAINER_STATE_TENSORS_NAME):
        assert again[name] == (tmp_path / "v4" / name).read_bytes(), name


def test_a_non_finite_loss_on_one_rank_fails_the_update_on_every_rank_and_the_next_one_runs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Only the rank holding the poisoned sample meets the overflow; the others must not wait for it in a
    collective: every rank refuses the update, none applies it, and the next update is the one-rank update."""
    config = _config()
    samples = _base_version(tiny_model_dir, config, tmp_path / "base")
    ops = [["load", str(tmp_path / "base")], ["step_poisoned", 0], ["step"]]
    expected = _timings_out(_on_one_rank(_plan(tiny_model_dir, config, samples, ops), tiny_model_dir, config))
    got = _timings_out(_on_two_ranks(_plan(tiny_model_dir, config, samples, ops), tmp_path / "plan.json"))
    assert got[1] == expected[1] == "non_finite"
    _close(got, expected)
