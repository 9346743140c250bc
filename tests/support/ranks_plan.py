"""A trainer over the ranks of one ``torch.distributed.run`` launch, following a plan written by a test.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/support/ranks_plan.py PLAN.json

The plan (JSON): ``model`` (a local model folder), ``config`` (the run config's JSON), ``samples`` (train
samples' fields) and ``ops``, each one of ``["load", folder]`` (a version's files), ``["step"]``,
``["step_poisoned", index]`` (one sample's ratio overflowing), ``["rescore"]``, ``["rescore_under", folder]``
(ratio sums under another version's adapter) and ``["save", folder, version]``. Rank 0 writes each op's
result to the plan's path with ``.results.json``: what ``run_plan`` in the test process returns for one rank,
so the two compare directly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.run.config import RunConfig
from worker.algo.grpo import NonFiniteError
from worker.model.policy import Policy
from worker.optimize.batch import TrainSample
from worker.optimize.ranks import BUILD, Ranks, follow, join, leave
from worker.optimize.trainer import Trainer
from worker.optimize.trainer_state import VERSION_FILE_NAMES
from worker.process.settings import RankSettings


def read_files(folder: str) -> dict[str, bytes]:
    return {name: (Path(folder) / name).read_bytes() for name in VERSION_FILE_NAMES}


def run_plan(plan: dict[str, Any], trainer: Trainer) -> list[Any]:
    """Each op's result (floats and lists only), run on ``trainer``; the same code serves 1 rank and N."""
    samples = [TrainSample(**fields) for fields in plan["samples"]]
    results: list[Any] = []
    for op in plan["ops"]:
        if op[0] == "load":
            results.append(trainer.load_version_files(read_files(op[1])))
        elif op[0] == "step":
            metrics, sums = trainer.step_with_ratio_sums(samples)
            results.append({"metrics": metrics.model_dump(), "ratio_sums": sums})
        elif op[0] == "step_poisoned":  # sample ``op[1]`` made to overflow its ratio: the update must fail
            poisoned = list(samples)
            bad = poisoned[op[1]]
            poisoned[op[1]] = TrainSample(
                bad.prompt_token_ids, bad.completion_token_ids, [-1e4] * len(bad.behavior_logprobs), bad.advantage
            )
            try:
                trainer.step(poisoned)
                results.append("updated")
            except NonFiniteError:
                results.append("non_finite")
        elif op[0] == "rescore":
            results.append(trainer.rescore(samples))
        elif op[0] == "rescore_under":
            values = trainer.lora_values(read_files(op[1])["adapter_model.safetensors"])
            results.append(trainer.rescore_ratio_sums(samples, lora_values=values))
        elif op[0] == "save":
            folder = Path(op[1])
            folder.mkdir(parents=True, exist_ok=True)
            for name, data in trainer.version_files(int(op[2])).items():
                (folder / name).write_bytes(data)
            results.append(None)
        else:
            raise ValueError(f"unknown op {op!r}")
    return results


def build_trainer(plan: dict[str, Any], ranks: Ranks, config_json: str) -> Trainer:
    return Trainer.initial(Policy.load(plan["model"]), RunConfig.model_validate_json(config_json), ranks)


def main() -> int:
    plan_path = Path(sys.argv[1])
    plan = json.loads(plan_path.read_text())
    torch.set_num_threads(1)
    place = RankSettings()
    ranks = join(60.0, "cpu", place.world_size, place.local_rank)
    if not ranks.leader:
        return follow(ranks, lambda config_json: build_trainer(plan, ranks, config_json))
    ranks.announce(BUILD, (plan["config"],))
    trainer = build_trainer(plan, ranks, plan["config"])
    results = run_plan(plan, trainer)
    plan_path.with_suffix(".results.json").write_text(json.dumps({"world": ranks.world, "results": results}))
    leave(ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
