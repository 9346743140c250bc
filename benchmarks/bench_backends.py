"""Generation backends side by side on the tiny model: tokens/s, adapter switch time, rescoring ratio.

    .venv-vllm/bin/python benchmarks/bench_backends.py            # both backends (vLLM's environment)
    python3 benchmarks/bench_backends.py                           # transformers only, where vLLM is missing

For each backend: warm generation throughput (completion tokens per second of wall time) on two workloads,
the time to load a new adapter version, and the first generation after switching to it. For vLLM also the
mean importance ratio of its samples rescored by the trainer (1 when the served policy is the trained one).
Figures vary with machine load; run it on an idle machine. Prints one line per figure and a JSON summary.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.run.config import RunConfig
from worker.model.policy import Policy
from worker.model.tiny_model import ensure_tiny_model
from worker.optimize.batch import TrainSample
from worker.optimize.trainer import Trainer, mean_ratio
from worker.optimize.trainer_state import write_adapter_folder

TEMPERATURE = 1.0
# (name, prompts, samples per prompt, max new tokens): the demo's generate task, and a larger batch.
WORKLOADS = [("demo task 4x8x16", 4, 8, 16), ("batch 32x8x64", 32, 8, 64)]


def make_versions(base: Path, count: int, folder: Path) -> tuple[Trainer, list[dict[str, bytes]], list[Path]]:
    """``count`` adapter versions of the tiny model made by real trainer updates, written as PEFT folders."""
    config = RunConfig.model_validate(
        {"model": {"base": str(base)}, "optimizer": {"learning_rate": 0.05}, "sampling": {"temperature": TEMPERATURE}}
    )
    trainer = Trainer.initial(Policy.load(str(base), device="cpu"), config)
    tokenizer, eos = trainer.policy.tokenizer, trainer.policy.eos_token_id
    prompts = trainer.policy.encode_prompts(["1=", "4=", "7="])
    files, folders = [], []
    for version in range(count):
        if version:
            good = [tokenizer.convert_tokens_to_ids(str(version % 10))] * 4 + [eos]
            samples = [TrainSample(p, good, [0.0] * len(good), 1.0) for p in prompts]
            samples += [TrainSample(p, [eos], [0.0], -1.0) for p in prompts]
            current = trainer.rescore(samples)
            trainer.step([replace(s, behavior_logprobs=lp) for s, lp in zip(samples, current, strict=True)])
        files.append(trainer.version_files(version))
        folders.append(write_adapter_folder(files[-1], folder / f"v{version}"))
    return trainer, files, folders


def prompts_for(count: int) -> list[str]:
    return [f"{index % 10}=" for index in range(count)]


def throughput(backend: Any, adapter: str, prompts: int, samples: int, new_tokens: int, repeats: int) -> float:
    rates = []
    for repeat in range(repeats + 1):
        result = backend.generate(
            prompts_for(prompts),
            adapter=adapter,
            samples_per_prompt=samples,
            max_completion_length=new_tokens,
            temperature=TEMPERATURE,
            top_p=1.0,
            seed=repeat,
        )
        if repeat:  # the first call warms up
            rates.append(result.timings.completion_tokens / result.timings.generate_s)
    return statistics.median(rates)


def adapter_switch(backend: Any, folders: list[Path], first: int) -> dict[str, float]:
    """Load versions first, first+1, ... and time each load and the first small generation that uses it."""
    loads, first_calls, steady_calls = [], [], []
    for version in range(first, len(folders)):
        name = f"v{version}"
        started = time.perf_counter()
        backend.load_adapter(name, version, folders[version])
        loads.append(time.perf_counter() - started)
        for calls in (first_calls, steady_calls):
            started = time.perf_counter()
            backend.generate(
                ["3="], adapter=name, samples_per_prompt=2, max_completion_length=4, temperature=1.0, top_p=1.0, seed=0
            )
            calls.append(time.perf_counter() - started)
        backend.drop_adapter(name)
    return {
        "load_adapter_ms": 1000 * statistics.median(loads),
        "first_generate_after_switch_ms": 1000 * statistics.median(first_calls),
        "same_generate_warm_ms": 1000 * statistics.median(steady_calls),
    }


def bench_backend(name: str, backend: Any, folders: list[Path], repeats: int) -> dict[str, Any]:
    backend.load_adapter("v1", 1, folders[1])
    figures: dict[str, Any] = {}
    for label, prompts, samples, new_tokens in WORKLOADS:
        rate = throughput(backend, "v1", prompts, samples, new_tokens, repeats)
        figures[f"tokens_per_s[{label}]"] = rate
        print(f"{name:>12}  {label:<18} {rate:10.0f} completion tokens/s")
    backend.drop_adapter("v1")
    switch = adapter_switch(backend, folders, first=2)
    figures.update(switch)
    print(
        f"{name:>12}  adapter switch: load {switch['load_adapter_ms']:.1f} ms, first generate after it "
        f"{switch['first_generate_after_switch_ms']:.1f} ms (warm {switch['same_generate_warm_ms']:.1f} ms)"
    )
    return figures


def vllm_ratio(backend: Any, trainer: Trainer, files: list[dict[str, bytes]], folders: list[Path]) -> float:
    backend.load_adapter("v1", 1, folders[1])
    result = backend.generate(
        prompts_for(16), adapter="v1", samples_per_prompt=8, max_completion_length=16, temperature=TEMPERATURE, seed=7
    )
    backend.drop_adapter("v1")
    samples = [
        TrainSample(p.prompt_token_ids, c.token_ids, c.logprobs, 0.0, 1) for p in result.results for c in p.completions
    ]
    trainer.load_version_files(files[1])
    return mean_ratio([s.behavior_logprobs for s in samples], trainer.rescore(samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per workload (after one warm-up)")
    args = parser.parse_args()
    have_vllm = importlib.util.find_spec("vllm") is not None
    summary: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        base = ensure_tiny_model(cache_dir=Path(tmp) / "cache")
        trainer, files, folders = make_versions(base, 8, Path(tmp) / "adapters")

        from worker.generate.transformers_backend import TransformersBackend

        transformers_backend = TransformersBackend(str(base), device="cpu")
        summary["transformers"] = bench_backend("transformers", transformers_backend, folders, args.repeats)
        del transformers_backend

        if have_vllm:
            from worker.generate.vllm_backend import VLLMBackend

            vllm_backend = VLLMBackend(str(base), max_loras=4, max_lora_rank=8, max_model_len=128)
            summary["vllm_engine_start_s"] = vllm_backend.engine_start_s
            summary["vllm"] = bench_backend("vllm", vllm_backend, folders, args.repeats)
            ratio = vllm_ratio(vllm_backend, trainer, files, folders)
            summary["vllm_vs_trainer_mean_ratio"] = ratio
            print(f"{'vllm':>12}  trainer rescoring of 128 vLLM samples (fp32): mean ratio {ratio:.9f}")
        else:
            print("vLLM is not installed here: run this with .venv-vllm/bin/python for the vLLM figures")
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
