"""Padded vs padding-free micro-batches in ``Trainer.step`` on a long-tailed length mix, and the step over
1 vs 2 ranks.

    python3 benchmarks/bench_trainer_packing.py                          # tiny model, 64 sequences, 8-512 tokens
    python3 benchmarks/bench_trainer_packing.py --ranks                  # also 1 rank vs 2 ranks (gloo, CPU)
    python3 benchmarks/bench_trainer_packing.py --hidden 512 --layers 4  # a wider, deeper model of the same family
    python3 benchmarks/bench_trainer_packing.py --micro-batch-tokens 1024 --reps 9 --threads 2

The batch looks like a math run's: ``--prompts`` prompts of 8-32 tokens, ``--group`` completions each, their
lengths drawn from a seeded log-normal (median ``--median``, sigma 1) clipped to [8, 512]: most short, a few
at the cap. Tokens are the tokenizer's digits; the behaviour logprobs are the policy's own (the batch is on
policy) and the advantages are group-normalised seeded rewards. The tiny model (``ensure_tiny_model``: Qwen2,
hidden 128, 2 layers, 14-token vocabulary) is built into a temporary folder; ``--hidden/--layers`` build a
random model of the same family and tokenizer instead (head dim 32, half as many KV heads, MLP 2 x hidden).
The tiny model's config says 256 positions; its rotary embeddings are computed from the position ids, so the
longer sequences here run as any other.

Layouts (``optimizer.padding_free``, ``worker/optimize/batch.py``): two trainers built alike but for the
layout, both with ``optimizer.micro_batch_tokens = --micro-batch-tokens`` (default: the run config's default,
8192), step on the same batch, interleaved
(padded, padding-free, padded, ...) after one warm-up step each; figures are medians over the repetitions and
the ratio is the median of the per-repetition ratios.

* ``tokens/s``: real completion tokens of the batch / wall seconds of one ``Trainer.step``.
* ``padding``: a micro-batch's padding share, 1 - real tokens / positions computed
  (``batch.positions_computed``), mean and max over the step's micro-batches, and ``all`` over the step.
* ``attn x``: query-key pairs the attention kernel computes over the pairs causal attention inside each
  sequence needs (sum of L(L+1)/2). Padded: each row's padded length squared, rows x longest^2 (SDPA with the
  padding mask). Padding-free: each sequence's own L^2, as ``worker.model.attention`` runs causal attention
  on each sequence's slice of the packed row (flash-attention's varlen kernel, where installed, skips the
  masked half too); a dense (T, T) block-diagonal mask over the whole row would cost T^2 instead.

``--ranks``: the padding-free step on 1 rank vs 2 ranks (``torch.distributed.run --standalone
--nproc-per-node 2`` as a subprocess, gloo on CPU, the frozen base sharded with FSDP2, each rank
OMP_NUM_THREADS=1; this file is the per-rank script, through a hidden flag). Rank 0 also holds a trainer of
one rank and times it with 1 thread and with 2 threads, interleaved with the 2-rank step (while it runs
alone, rank 1 waits in a blocking receive that uses no CPU). Report only: the machine this was written on
has 2 cores, so 2 ranks x 1 thread have no more compute than 1 rank x 2 threads and no speed-up over that is
expected; the figures show what the ranks cost (the leader sending the batch, FSDP's per-layer all-gathers,
the gradient all-reduce, an uneven deal of micro-batches: the dealt positions are printed). Against 1 rank
x 1 thread, 2 ranks use twice the cores.

Prints a table and one JSON line; asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from asyncgrpo.run.config import OptimizerConfig, RunConfig
from worker.algo.advantages import group_advantages
from worker.model.policy import Policy
from worker.model.tiny_model import ensure_tiny_model
from worker.optimize.batch import TrainSample, deal_to_ranks, plan_micro_batches, positions_computed
from worker.optimize.trainer import Trainer

LAYOUTS = {"padded": False, "padding-free": True}
MIN_COMPLETION, MAX_COMPLETION = 8, 512
MIN_PROMPT, MAX_PROMPT = 8, 32


def _interleaved(actions: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    for action in actions.values():
        action()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in actions}
    for _ in range(reps):
        for name, action in actions.items():
            started = time.perf_counter()
            action()
            times[name].append(time.perf_counter() - started)
    return times


def _per_rep_ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def _model(tmp: Path, hidden: int | None, layers: int | None) -> Path:
    """The tiny model's folder, or a random model of its family with ``hidden``/``layers`` (and its tokenizer)."""
    tiny = ensure_tiny_model(cache_dir=tmp / "cache")
    if hidden is None and layers is None:
        return tiny
    from transformers import AutoConfig, Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(tiny)
    config.hidden_size = hidden or config.hidden_size
    config.num_hidden_layers = layers or config.num_hidden_layers
    if getattr(config, "layer_types", None) is not None:  # one entry per layer: saved for the tiny model's count
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    config.num_attention_heads = max(1, config.hidden_size // 32)
    config.num_key_value_heads = max(1, config.num_attention_heads // 2)
    config.intermediate_size = 2 * config.hidden_size
    config.max_position_embeddings = max(config.max_position_embeddings, MAX_PROMPT + MAX_COMPLETION)
    folder = tmp / f"model-h{config.hidden_size}-l{config.num_hidden_layers}"
    shutil.copytree(tiny, folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def _config(args: argparse.Namespace, padding_free: bool) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"dtype": args.dtype},
            "sampling": {"samples_per_prompt": args.group, "max_completion_length": MAX_COMPLETION},
            "optimizer": {"micro_batch_tokens": args.micro_batch_tokens, "padding_free": padding_free},
        }
    )


def _make_batch(policy: Policy, args: argparse.Namespace) -> list[TrainSample]:
    """The long-tailed batch, with zero behaviour logprobs (``_on_policy`` fills them) and seeded advantages."""
    digits = policy.tokenizer.convert_tokens_to_ids(list("0123456789"))
    rng = random.Random(args.seed)
    samples = []
    for _ in range(args.prompts):
        prompt = [rng.choice(digits) for _ in range(rng.randint(MIN_PROMPT, MAX_PROMPT))]
        rewards = [float(rng.random() < 0.5) for _ in range(args.group)]
        for advantage in group_advantages(rewards, args.group).tolist():
            drawn = round(rng.lognormvariate(math.log(args.median), 1.0))
            length = min(MAX_COMPLETION, max(MIN_COMPLETION, drawn))
            completion = [rng.choice(digits) for _ in range(length)]
            samples.append(TrainSample(prompt, completion, [0.0] * length, advantage))
    return samples


def _on_policy(trainer: Trainer, samples: list[TrainSample]) -> list[TrainSample]:
    """The samples with the trainer's own logprobs as behaviour logprobs: ratios start at 1, as on policy."""
    logprobs = trainer.rescore(samples)
    return [dataclasses.replace(sample, behavior_logprobs=lp) for sample, lp in zip(samples, logprobs, strict=True)]


def _plan_figures(lengths: list[int], budget: int, padding_free: bool) -> dict[str, Any]:
    plan = plan_micro_batches(lengths, budget, padding_free)
    real = [sum(lengths[i] for i in batch) for batch in plan]
    computed = [positions_computed([lengths[i] for i in batch], padding_free) for batch in plan]
    shares = [1 - r / c for r, c in zip(real, computed, strict=True)]
    if padding_free:
        # worker.model.attention: each sequence of a row attends over its own slice (L^2 per sequence).
        pairs = sum(length * length for length in lengths)
    else:
        pairs = sum(len(batch) * max(lengths[i] for i in batch) ** 2 for batch in plan)
    needed = sum(length * (length + 1) // 2 for length in lengths)
    dealt = deal_to_ranks(computed, 2)
    return {
        "micro_batches": len(plan),
        "padding_mean": statistics.mean(shares),
        "padding_max": max(shares),
        "padding_all": 1 - sum(real) / sum(computed),
        "positions": sum(computed),
        "attention_pairs_x": pairs / needed,
        "two_rank_positions": [sum(computed[i] for i in part) for part in dealt],
    }


# ---- 1 rank vs 2 ranks ----


def _two_ranks(plan: dict[str, Any], tmp: Path) -> dict[str, list[float]]:
    """Run this file as the per-rank script of a 2-rank launch; rank 0's timings."""
    path = tmp / "ranks-plan.json"
    path.write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*argv, str(Path(__file__).resolve()), "--rank-worker", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"the 2-rank launch failed with status {done.returncode}")
    return json.loads(path.with_suffix(".results.json").read_text())


def _rank_worker(plan_path: Path) -> int:
    """One rank of the ``--ranks`` launch. Rank 0 times the 2-rank step and its own 1-rank trainer."""
    from worker.optimize.ranks import BUILD, follow, join, leave
    from worker.process.settings import RankSettings

    plan = json.loads(plan_path.read_text())
    torch.set_num_threads(1)
    place = RankSettings()
    ranks = join(120.0, "cpu", place.world_size, place.local_rank)

    def build(config_json: str, of: Any = ranks) -> Trainer:
        return Trainer.initial(Policy.load(plan["model"]), RunConfig.model_validate_json(config_json), of)

    if not ranks.leader:
        return follow(ranks, build)
    ranks.announce(BUILD, (plan["config"],))
    spread = build(plan["config"])
    single = build(plan["config"], None)
    samples = [TrainSample(**fields) for fields in plan["samples"]]

    def threaded(trainer: Trainer, threads: int) -> Callable[[], object]:
        def action() -> None:
            torch.set_num_threads(threads)
            try:
                trainer.step(samples)
            finally:
                torch.set_num_threads(1)

        return action

    times = _interleaved(
        {
            "1 rank, 1 thread": threaded(single, 1),
            "1 rank, 2 threads": threaded(single, 2),
            "2 ranks x 1 thread": threaded(spread, 1),
        },
        plan["reps"],
    )
    plan_path.with_suffix(".results.json").write_text(json.dumps(times))
    leave(ranks)
    return 0


# ---- main ----


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--median", type=float, default=64.0, help="median completion length (log-normal)")
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=OptimizerConfig().micro_batch_tokens,  # what a run uses unless its config says otherwise
        help="optimizer.micro_batch_tokens (default: the run config's default)",
    )
    parser.add_argument("--hidden", type=int, default=None, help="hidden size of a model of the tiny family")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of a model of the tiny family")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of the layout comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", action="store_true", help="also time the padding-free step on 1 vs 2 ranks")
    parser.add_argument("--rank-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker is not None:
        sys.exit(_rank_worker(args.rank_worker))
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench-packing-") as tmp_name:
        tmp = Path(tmp_name)
        model = _model(tmp, args.hidden, args.layers)
        trainers = {
            name: Trainer.initial(Policy.load(str(model), dtype=args.dtype), _config(args, pf))
            for name, pf in LAYOUTS.items()
        }
        for name, pf in LAYOUTS.items():  # a trainer runs padded where packing would not be exact (it warns)
            if getattr(trainers[name], "padding_free", pf) != pf:
                raise SystemExit(f"the {name} trainer did not take the {name} layout; nothing to compare")
        shape = trainers["padded"].policy.model.config
        samples = _on_policy(trainers["padded"], _make_batch(trainers["padded"].policy, args))
        lengths = [sample.length for sample in samples]
        completions = sorted(len(sample.completion_token_ids) for sample in samples)
        tokens = sum(completions)
        plans = {name: _plan_figures(lengths, args.micro_batch_tokens, pf) for name, pf in LAYOUTS.items()}
        times = _interleaved(
            {name: (lambda t=trainer: t.step(samples)) for name, trainer in trainers.items()}, args.reps
        )
        ranks_times = None
        if args.ranks:
            plan = {
                "model": str(model),
                "config": _config(args, True).model_dump_json(by_alias=True),
                "samples": [dataclasses.asdict(sample) for sample in samples],
                "reps": args.reps,
            }
            ranks_times = _two_ranks(plan, tmp)

    speedup = _per_rep_ratio(times["padded"], times["padding-free"])
    print(
        f"model: hidden {shape.hidden_size}, {shape.num_hidden_layers} layers, vocab {shape.vocab_size}"
        f"{' (the tiny model)' if args.hidden is None and args.layers is None else ''}; batch: {args.prompts} "
        f"prompts x G={args.group} = {len(samples)} sequences, prompts {MIN_PROMPT}-{MAX_PROMPT} tokens, completions "
        f"{completions[0]}-{completions[-1]} tokens (median {statistics.median(completions):.0f}, "
        f"p90 {completions[int(0.9 * (len(completions) - 1))]}, {completions.count(MAX_COMPLETION)} at the cap), "
        f"{tokens} completion tokens, {sum(lengths)} positions; micro_batch_tokens {args.micro_batch_tokens}; "
        f"{args.threads} thread(s), {args.reps} interleaved reps"
    )
    header = (
        f"{'layout':<14}{'micro-b':>8}{'padding mean':>14}{'max':>7}{'all':>7}{'positions':>11}{'attn x':>8}"
        f"{'median s':>10}{'tokens/s':>10}"
    )
    print(header)
    for name, figures in plans.items():
        step_s = statistics.median(times[name])
        print(
            f"{name:<14}{figures['micro_batches']:>8}{figures['padding_mean']:>14.3f}{figures['padding_max']:>7.3f}"
            f"{figures['padding_all']:>7.3f}{figures['positions']:>11}{figures['attention_pairs_x']:>8.2f}"
            f"{step_s:>10.3f}{tokens / step_s:>10.0f}"
        )
    print(f"padding-free / padded tokens/s (median of per-rep ratios): {speedup:.3f}")
    result: dict[str, Any] = {
        "hidden": shape.hidden_size,
        "layers": shape.num_hidden_layers,
        "sequences": len(samples),
        "completion_tokens": tokens,
        "positions": sum(lengths),
        "micro_batch_tokens": args.micro_batch_tokens,
        "threads": args.threads,
        "reps": args.reps,
        **{
            f"{name.replace('-', '_')}_{key}": (round(value, 4) if isinstance(value, float) else value)
            for name, figures in plans.items()
            for key, value in figures.items()
            if key != "two_rank_positions"
        },
        **{f"{name.replace('-', '_')}_step_median_s": round(statistics.median(t), 5) for name, t in times.items()},
        **{
            f"{name.replace('-', '_')}_tokens_per_s": round(tokens / statistics.median(t), 1)
            for name, t in times.items()
        },
        "padding_free_vs_padded": round(speedup, 4),
    }
    if ranks_times is not None:
        one = ranks_times["1 rank, 1 thread"]
        print(
            f"ranks: padding-free step; micro-batch positions dealt to 2 ranks: "
            f"{plans['padding-free']['two_rank_positions']}"
        )
        print(f"{'setup':<22}{'median s':>10}{'tokens/s':>10}{'vs 1 rank, 1 thread':>21}")
        for name, values in ranks_times.items():
            step_s = statistics.median(values)
            print(f"{name:<22}{step_s:>10.3f}{tokens / step_s:>10.0f}{_per_rep_ratio(one, values):>21.3f}")
        keys = {
            "1 rank, 1 thread": "one_rank_1t",
            "1 rank, 2 threads": "one_rank_2t",
            "2 ranks x 1 thread": "two_ranks",
        }
        result.update(
            {f"{keys[n]}_tokens_per_s": round(tokens / statistics.median(v), 1) for n, v in ranks_times.items()}
        )
        result["two_ranks_vs_one_rank_1t"] = round(_per_rep_ratio(one, ranks_times["2 ranks x 1 thread"]), 4)
        result["two_ranks_vs_one_rank_2t"] = round(
            _per_rep_ratio(ranks_times["1 rank, 2 threads"], ranks_times["2 ranks x 1 thread"]), 4
        )
        result["two_rank_positions"] = plans["padding-free"]["two_rank_positions"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
