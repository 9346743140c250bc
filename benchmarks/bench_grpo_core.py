"""How long the GRPO core takes on the tiny model: generate, rescore, one optimizer step, version files.

    python3 benchmarks/bench_grpo_core.py
    python3 benchmarks/bench_grpo_core.py --prompts 8 --group 8 --max-new-tokens 32 --reps 5 --threads 2

The tiny model is built into a temporary cache (no download). Generation goes through the real
``TransformersBackend`` with the trainer's adapter loaded from its version files; rescore and step are the
``Trainer``'s. Figures are the median and min seconds over ``--reps`` repetitions after one warm-up.
Prints a table and one JSON line; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from proxy.run.config import RunConfig
from worker.algo.grpo import group_advantages
from worker.algo.rewards import repeat_digit
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import Policy
from worker.model.tiny_model import ensure_tiny_model
from worker.optimize.trainer import Trainer, TrainSample
from worker.optimize.trainer_state import write_adapter_folder


def _timed(action: Callable[[int], object], reps: int) -> tuple[float, float]:
    action(-1)  # warm-up
    times = []
    for rep in range(reps):
        started = time.perf_counter()
        action(rep)
        times.append(time.perf_counter() - started)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        base = str(ensure_tiny_model(cache_dir=Path(tmp)))
        config = RunConfig.model_validate(
            {"sampling": {"samples_per_prompt": args.group, "max_completion_length": args.max_new_tokens}}
        )
        trainer = Trainer.initial(Policy.load(base), config)
        backend = TransformersBackend(base)
        prompts = [f"{i % 10}=" for i in range(args.prompts)]

        state: dict[str, object] = {}

        def publish(rep: int) -> None:
            state["files"] = trainer.version_files(max(rep, 0))

        def load_adapter(rep: int) -> None:
            folder = write_adapter_folder(state["files"], Path(tmp) / f"adapter-{rep}")
            backend.load_adapter(f"v{rep}", rep, folder)
            state["adapter"] = f"v{rep}"

        def generate(rep: int) -> None:
            result = backend.generate(
                prompts,
                adapter=state["adapter"],
                samples_per_prompt=args.group,
                max_new_tokens=args.max_new_tokens,
                temperature=1.0,
                top_p=1.0,
                seed=rep + 1,
            )
            samples = []
            for prompt_result in result.results:
                rewards = [repeat_digit(prompt_result.prompt, c.text, None) for c in prompt_result.completions]
                advantages = group_advantages(rewards, args.group).tolist()
                samples += [
                    TrainSample(prompt_result.prompt_token_ids, c.token_ids, c.logprobs, a)
                    for c, a in zip(prompt_result.completions, advantages, strict=True)
                ]
            state["samples"] = samples
            state["tokens"] = result.timings.completion_tokens

        def load_trainer_state(rep: int) -> None:
            trainer.load_version_files(state["files"])

        figures: dict[str, tuple[float, float]] = {}
        figures["version_files"] = _timed(publish, args.reps)
        figures["load_adapter"] = _timed(load_adapter, args.reps)
        figures["generate"] = _timed(generate, args.reps)
        figures["rescore"] = _timed(lambda rep: trainer.rescore(state["samples"]), args.reps)
        figures["optimizer_step"] = _timed(lambda rep: trainer.step(state["samples"]), args.reps)
        figures["load_version_files"] = _timed(load_trainer_state, args.reps)

    sequences = args.prompts * args.group
    print(
        f"tiny model, {args.prompts} prompts x G={args.group} = {sequences} sequences, up to "
        f"{args.max_new_tokens} new tokens ({state['tokens']} sampled in the last batch), "
        f"{args.threads} thread(s), {args.reps} reps"
    )
    print(f"{'operation':<20}{'median s':>12}{'min s':>12}")
    for name, (median, best) in figures.items():
        print(f"{name:<20}{median:>12.4f}{best:>12.4f}")
    print(
        json.dumps(
            {
                "sequences": sequences,
                "max_new_tokens": args.max_new_tokens,
                "threads": args.threads,
                **{f"{name}_median_s": round(values[0], 5) for name, values in figures.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
