"""How long the GRPO core takes on the tiny model, and how our code compares with bare PyTorch + PEFT.

    python3 benchmarks/bench_grpo_core.py                       # tiny: 8 prompts x 8 samples x 8 tokens
    python3 benchmarks/bench_grpo_core.py --workload compute    # same model, 128-256 completion tokens
    python3 benchmarks/bench_grpo_core.py --prompts 8 --group 8 --max-completion-length 32 --reps 9 --threads 2
    python3 benchmarks/bench_grpo_core.py --layout padded       # trainer and floor in padded micro-batches

The tiny model is built into a temporary cache (no download). One training batch is sampled once through
our sampling loop (for ``compute`` without stopping at EOS, then each completion cut to a seeded length in
[128, max]) and every training operation runs on that same batch. Operations are interleaved within each
repetition (A, B, C, A, B, C, ...) after one warm-up, so a noisy shared machine slows them alike; figures are
medians, and each ratio is the median of the per-repetition ratios. Component ratios:

* ``step_vs_bare``: ``Trainer.step`` against a bare PEFT forward + clipped-ratio loss + backward + grad
  clipping + AdamW step over the very same micro-batches (collated beforehand: the floor, without our
  collate, diagnostics, checks and RNG bookkeeping). Target <= 1.25. Both run the layout ``--layout`` names
  (``optimizer.padding_free``, pinned in the config; default padding-free, the trainer's default; the line
  printed first names the layout the trainer took): the floor forwards a padding-free micro-batch as the
  trainer does (one row, position ids restarting per sequence, logits of the completion positions only) and
  a padded one as rows x longest, so the ratio compares the same work either way.
* ``sampling_vs_generate``: our ``sample_completions`` (tokens and per-token logprobs) against transformers'
  ``model.generate(do_sample=True, top_k=0, output_scores=True)`` plus the gather of the sampled tokens'
  logprobs from its scores, same rows, same adapter, same length. Target <= 1.0.
* ``rescore_share``: the optimize job's rescoring in steady state (half the rollouts one version stale;
  fresh ones reuse the training forward, stale ones are sampled at ``loss.rescore_stale_fraction``) over a
  step (rescoring + ``Trainer.step``). Target <= 0.10. ``rescore_step_share`` adds the version files to the
  step, as the step records' ``step_s`` does (fetching the rollouts left out). ``rescore_all_share`` is
  rescoring every sequence in a separate forward (the behaviour before ``rescore_stale_fraction``).
* ``correction_cost``: what the generator-trainer correction (``loss.vllm_importance_sampling_correction``,
  on by default for vLLM's rollouts) adds to that steady-state step: every stale sequence rescored per token
  under its version instead of a sample of them, and the weighted loss; (corrected rescoring + corrected step)
  / (rescoring + step) - 1.

Prints a table and one JSON line; asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from asyncgrpo.bucket.backends import open_bucket
from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import RunConfig
from worker.algo.advantages import group_advantages
from worker.algo.rewards import repeat_digit
from worker.algo.rollout import Rollout, RolloutSample
from worker.generate.transformers_backend import TransformersBackend, sample_completions
from worker.model.policy import Policy
from worker.model.tiny_model import ensure_tiny_model
from worker.optimize.batch import MicroBatch, TrainSample
from worker.optimize.trainer import Trainer
from worker.optimize.trainer_state import write_adapter_folder

WORKLOADS = {"tiny": (8, 8, 8), "compute": (8, 8, 252)}  # prompts, group, max new tokens (positions <= 256)


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


def _bare_step(trainer: Trainer, optimizer: torch.optim.Optimizer, batches: list[MicroBatch], tokens: int) -> None:
    """Forward, dapo clipped loss, backward per micro-batch; clip and AdamW: nothing but the math, in the
    micro-batches' own layout (padding-free: the completion tokens as one flat run, never laid out as (B, C))."""
    model, cfg = trainer.model, trainer.loss_cfg
    optimizer.zero_grad(set_to_none=True)
    for batch in batches:
        if batch.padding_free:
            out = model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                logits_to_keep=batch.logit_positions,
            )
            logits = out.logits[0] / trainer.temperature  # (K, V): the positions predicting completion tokens
            targets, behavior = batch.completion_ids[batch.mask], batch.behavior_logprobs[batch.mask]
            adv = batch.advantages.unsqueeze(1).expand_as(batch.mask)[batch.mask]
            mask = None
        else:
            width = batch.completion_ids.shape[1]
            out = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                use_cache=False,
                logits_to_keep=width + 1,
            )
            logits = out.logits[:, -width - 1 : -1, :] / trainer.temperature
            targets, behavior, adv = batch.completion_ids, batch.behavior_logprobs, batch.advantages.unsqueeze(1)
            mask = batch.mask
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logprobs - behavior)
        clipped = torch.clamp(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        (per_token if mask is None else torch.where(mask, per_token, 0.0)).sum().div(tokens).backward()
    torch.nn.utils.clip_grad_norm_(trainer.lora_parameters, trainer.optimizer_cfg.max_grad_norm)
    optimizer.step()


def _hf_generate(model: torch.nn.Module, rows: list[list[int]], pad: int, eos: int | None, new_tokens: int) -> None:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attention = (torch.arange(width).unsqueeze(0) >= torch.tensor([width - len(r) for r in rows]).unsqueeze(1)).long()
    out = model.generate(
        input_ids=ids,
        attention_mask=attention,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=0,
        eos_token_id=eos,
        pad_token_id=pad,
        output_scores=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, width:]
    scores = torch.stack(out.scores, dim=1).float()
    torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1).tolist()


def _make_batch(backend: TransformersBackend, args: argparse.Namespace, long: bool) -> list[TrainSample]:
    prompts = [f"{i % 10}=" for i in range(args.prompts)]
    prompt_ids = backend.tokenize(prompts)
    rows = [ids for ids in prompt_ids for _ in range(args.group)]
    eos = -1 if long else backend.eos_token_id  # -1: never stop early, so completions are long
    with torch.no_grad():
        tokens, logprobs, _ = sample_completions(
            backend._select("v0"),
            rows,
            max_completion_length=args.max_completion_length,
            temperature=1.0,
            top_p=1.0,
            seed=1,
            eos_token_id=eos,
            pad_token_id=backend.policy.pad_token_id,
            device=backend.policy.device,
        )
    cut = random.Random(0)
    samples = []
    for p_index, prompt in enumerate(prompts):
        group = range(p_index * args.group, (p_index + 1) * args.group)
        texts = [backend.policy.tokenizer.decode(tokens[row], skip_special_tokens=True) for row in group]
        advantages = group_advantages(
            [repeat_digit(prompt, text, None) + 0.01 * i for i, text in enumerate(texts)], args.group
        ).tolist()
        for row, advantage in zip(group, advantages, strict=True):
            longest = args.max_completion_length
            length = cut.randint(min(128, longest), longest) if long else len(tokens[row])
            samples.append(TrainSample(rows[row], tokens[row][:length], logprobs[row][:length], advantage))
    return samples


def _as_rollouts(samples: list[TrainSample], group: int, versions: list[int]) -> list[Rollout]:
    """The batch as rollouts of 4 groups each (the default groups_per_task), rollout i claiming
    ``versions[i % len(versions)]``."""
    rollouts = []
    per_rollout = 4 * group
    for index, start in enumerate(range(0, len(samples), per_rollout)):
        chunk = samples[start : start + per_rollout]
        rollout_samples = [
            RolloutSample(
                i // group, s.prompt_token_ids, s.completion_token_ids, s.behavior_logprobs, 0.0, s.advantage, "length"
            )
            for i, s in enumerate(chunk)
        ]
        groups = [GroupRef(group_id=f"t{index}.{g}", prompt_index=g) for g in range(4)]
        version = versions[index % len(versions)]
        rollouts.append(Rollout("bench", f"t{index}", version, "gen", groups, rollout_samples))
    return rollouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--group", type=int, default=None, help="samples per prompt (G)")
    # --max-new-tokens: its name before the config's word, kept for old command lines.
    parser.add_argument(
        "--max-completion-length", "--max-new-tokens", dest="max_completion_length", type=int, default=None
    )
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--layout",
        choices=("padding-free", "padded"),
        default="padding-free",
        help="micro-batch layout of the trainer and of the bare floor (optimizer.padding_free)",
    )
    args = parser.parse_args()
    defaults = WORKLOADS[args.workload]
    args.prompts = args.prompts or defaults[0]
    args.group = args.group or defaults[1]
    args.max_completion_length = args.max_completion_length or defaults[2]
    long = args.workload == "compute"
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        base = str(ensure_tiny_model(cache_dir=Path(tmp)))
        config = RunConfig.model_validate(
            {
                "sampling": {"samples_per_prompt": args.group, "max_completion_length": args.max_completion_length},
                "optimizer": {"padding_free": args.layout == "padding-free"},
            }
        )
        trainer = Trainer.initial(Policy.load(base), config)
        files = trainer.version_files(0)
        backend = TransformersBackend(base)
        backend.load_adapter("v0", 0, write_adapter_folder(files, Path(tmp) / "adapter-v0"))
        samples = _make_batch(backend, args, long)
        rows = [s.prompt_token_ids for s in samples]
        peft = backend._select("v0")
        eos = None if long else backend.eos_token_id
        bare_optimizer = torch.optim.AdamW(trainer.lora_parameters, lr=config.optimizer.learning_rate)
        batches = trainer._batches(samples)[0]  # one rank: its micro-batches are the whole plan
        layout = "padding-free" if batches[0].padding_free else "padded"  # as the trainer took it
        tokens = sum(len(s.completion_token_ids) for s in samples)

        def ours_sampling() -> None:
            with torch.no_grad():
                sample_completions(
                    peft,
                    rows,
                    max_completion_length=args.max_completion_length,
                    temperature=1.0,
                    top_p=1.0,
                    seed=2,
                    eos_token_id=-1 if long else backend.eos_token_id,
                    pad_token_id=backend.policy.pad_token_id,
                    device=backend.policy.device,
                )

        actions: dict[str, Callable[[], object]] = {
            "trainer_step": lambda: trainer.step(samples),
            "bare_step": lambda: _bare_step(trainer, bare_optimizer, batches, tokens),
            "rescore_all": lambda: trainer.rescore(samples),
            "our_sampling": ours_sampling,
            "hf_generate": lambda: _hf_generate(
                peft, rows, backend.policy.pad_token_id, eos, args.max_completion_length
            ),
            "version_files": lambda: trainer.version_files(1),
        }
        steady = _steady_rescore(trainer, config, samples, args.group, Path(tmp))
        if steady is not None:
            actions["rescore_steady"] = steady
        corrected = _steady_corrected(trainer, config, samples, args.group, Path(tmp))
        if corrected is not None:
            actions["rescore_corrected"], actions["step_corrected"] = corrected
        times = _interleaved(actions, args.reps)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    def share(a: str, b: str) -> float:
        return statistics.median(x / (x + y) for x, y in zip(times[a], times[b], strict=True))

    ratios = {
        "step_vs_bare": ratio("trainer_step", "bare_step"),
        "sampling_vs_generate": ratio("our_sampling", "hf_generate"),
        "rescore_all_share": share("rescore_all", "trainer_step"),
    }
    if "rescore_steady" in times:
        ratios["rescore_share"] = share("rescore_steady", "trainer_step")
        ratios["rescore_step_share"] = statistics.median(
            r / (r + t + v)
            for r, t, v in zip(times["rescore_steady"], times["trainer_step"], times["version_files"], strict=True)
        )
    if "step_corrected" in times:
        ratios["correction_cost"] = statistics.median(
            (rc + sc) / (r + t) - 1
            for rc, sc, r, t in zip(
                times["rescore_corrected"],
                times["step_corrected"],
                times["rescore_steady"],
                times["trainer_step"],
                strict=True,
            )
        )
    print(
        f"{args.workload}: tiny model, {args.prompts} prompts x G={args.group} = {len(samples)} sequences, "
        f"{tokens} completion tokens in the training batch ({len(batches)} micro-batches), up to "
        f"{args.max_completion_length} sampled, {layout}, {args.threads} thread(s), {args.reps} interleaved reps"
    )
    print(f"{'operation':<20}{'median s':>12}{'min s':>12}")
    for name, values in times.items():
        print(f"{name:<20}{statistics.median(values):>12.4f}{min(values):>12.4f}")
    for name, value in ratios.items():
        print(f"{name:<20}{value:>12.3f}")
    print(
        json.dumps(
            {
                "workload": args.workload,
                "sequences": len(samples),
                "tokens": tokens,
                "max_completion_length": args.max_completion_length,
                "layout": layout,
                "micro_batches": len(batches),
                "threads": args.threads,
                "reps": args.reps,
                **{f"{name}_median_s": round(statistics.median(values), 5) for name, values in times.items()},
                **{name: round(value, 4) for name, value in ratios.items()},
            }
        )
    )


def _kept_v0(trainer: Trainer) -> dict[str, Any]:
    """``rescore_planned``'s keyword holding version 0's weights, as the job keeps them after writing it (the
    optimizer's ``RecentAdapterWeights``; a module global in commits before it)."""
    weights = [p.detach().clone() for p in trainer.lora_parameters]
    try:
        from worker.optimize.rescore import RecentAdapterWeights
    except ImportError:
        from worker.optimize.rescore import remember_adapter_weights

        remember_adapter_weights("bench", 0, weights)
        return {}
    recent = RecentAdapterWeights()
    recent.remember("bench", 0, weights)
    return {"recent": recent}


def _steady_rescore(
    trainer: Trainer, config: RunConfig, samples: list[TrainSample], group: int, tmp: Path
) -> Callable[[], object] | None:
    """The job's rescoring of a steady-state batch (half the rollouts one version stale), if it has a plan."""
    try:
        from worker.optimize.rescore import plan_rescoring, rescore_planned
    except ImportError:  # before rescore_stale_fraction existed
        return None
    bucket = open_bucket(f"file://{tmp / 'bucket'}")
    kept = _kept_v0(trainer)
    rollouts = _as_rollouts(samples, group, [1, 0])
    owners = [index for index, r in enumerate(rollouts) for _ in r.samples]

    def action() -> None:
        plan = plan_rescoring(
            trainer,
            rollouts,
            owners,
            base_version=1,
            first_update=range(len(samples)),
            fraction=config.loss.rescore_stale_fraction,
            seed=0,
        )
        rescore_planned(trainer, bucket, "bench", 1, rollouts, samples, plan, **kept)

    return action


def _steady_corrected(
    trainer: Trainer, config: RunConfig, samples: list[TrainSample], group: int, tmp: Path
) -> tuple[Callable[[], object], Callable[[], object]] | None:
    """The same steady-state batch with every rollout from vLLM (the correction on): its rescoring, its step."""
    try:
        from worker.optimize.batch import build_train_samples
        from worker.optimize.rescore import plan_rescoring, rescore_planned
    except ImportError:
        return None
    if "corrected" not in {f.name for f in dataclasses.fields(TrainSample)}:  # before the correction existed
        return None
    bucket = open_bucket(f"file://{tmp / 'bucket-corrected'}")
    kept = _kept_v0(trainer)
    rollouts = _as_rollouts(samples, group, [1, 0])
    for rollout in rollouts:
        rollout.extra.sampler = "vllm"
    corrected, keys = build_train_samples(rollouts, config.loss)
    owners = [owner for owner, _ in keys]

    def rescore() -> None:
        plan = plan_rescoring(
            trainer,
            rollouts,
            owners,
            base_version=1,
            first_update=range(len(corrected)),
            fraction=config.loss.rescore_stale_fraction,
            seed=0,
            samples=corrected,
        )
        rescore_planned(trainer, bucket, "bench", 1, rollouts, corrected, plan, **kept)

    rescore()  # the stale samples' denominators, as the job sets them before the step
    return rescore, lambda: trainer.step(corrected)


if __name__ == "__main__":
    main()
