"""Does asynchrony pay? The real system against an in-process synchronous loop, side by side in one run.

    python3 benchmarks/bench_end_to_end.py                               # tiny and compute, every configuration
    python3 benchmarks/bench_end_to_end.py --workloads tiny --steps 100 --configs sync,s0,s2x1
    python3 benchmarks/bench_end_to_end.py --bucket seaweedfs            # a private SeaweedFS instead of file://
    python3 benchmarks/bench_end_to_end.py --workloads longtail --configs keep,follow,s0x2   # in-flight updates

Workloads (both random-init models built here, no download):

- *tiny*: the tiny model of ``asyncgrpo demo``, LoRA r8, "repeat the digit", 8 prompts x 8 samples x 8
  completion tokens per step, dapo, lr 3e-3. Training costs more than generation.
- *compute*: a ~4.5M-parameter Qwen2 model with a 2,048-token vocabulary (so that a random policy rarely
  samples EOS), 8 prompts x 8 samples x 128 completion tokens. Generation takes most of a step, as it does
  on GPUs with long completions; the ``sync`` line prints the split.
- *longtail*: the same architecture with a 128-token vocabulary, so that a random policy samples EOS about
  once in 128 tokens: geometric completion lengths up to 512 (median ~89, p90 ~295), the long-tailed mix of
  math runs, where a generate task waits for its longest completion.

Configurations:

- ``sync``: one process, no Redis, no bucket: sample with the trainer's own PEFT model, score, step, repeat,
  with every core (the floor a user compares against).
- ``s0``: the system (private redis-server, ``asyncgrpo proxy``, Celery workers started as an operator
  starts them, one torch thread each) with ``max_staleness = 0`` and one generate worker.
- ``s2x1`` / ``s2x2``: the system with ``max_staleness = 2`` and one / two generate workers.
- ``s4`` / ``s4full``: ``max_staleness = 4`` with a deep buffer (``queue_maxsize = 32``) and two generate
  workers, so the trainer is the bottleneck; with the proxy sizing its in-flight work from the rates it
  measures (``s4``) and with that sizing off, so the buffer stays full (``s4full``).
- ``keep`` / ``follow`` / ``s0x2``: two generate workers; ``max_staleness = 1`` keeping each task's leased
  version, the same following new versions mid-generation (``async.inflight_versions = "follow"``, tokens older
  than the window masked: ``async.stale_tokens = "mask"``), and ``max_staleness = 0`` (their synchronous mode);
  ``follow0``: ``max_staleness = 0`` following new versions, older tokens masked; ``keepnp``: ``keep`` with
  ``async.partial_rollouts = false`` (the cost of saving partial sequences to a task that is never stopped).

Each configuration prints one JSON line: completions/s and steps/s over the steps after a warm-up, trainer
and generator busy shares (task time over wall time, from the workers' own log lines), mean and max
staleness of trained samples (per rollout and per token), stale generate tasks and the tokens they threw away,
masked tokens, mean reward over the first and last 10 steps, and a per-step breakdown (medians). The last
line compares them: ratios measured side by side in this run. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from asyncgrpo.protocol.records import StepRecord
from asyncgrpo.run.config import RunConfig, load_run_config
from asyncgrpo.run.creation import create_run
from asyncgrpo.run.datasets import build_dataset
from cli.history import load_step_records
from cli.local_cluster import LocalCluster
from tests.support.fixtures_s3 import open_env_bucket
from worker.algo.advantages import group_advantages
from worker.algo.rewards import score_completions
from worker.generate.transformers_backend import sample_completions
from worker.model.policy import Policy
from worker.model.tiny_model import ensure_tiny_model
from worker.optimize.batch import TrainSample
from worker.optimize.trainer import Trainer


@dataclass(frozen=True)
class Workload:
    name: str
    completion_tokens: int
    steps: int
    warmup_steps: int  # left out of the rates: model loading, first compilations, filling the buffer
    timeout_s: float


WORKLOADS = {
    "tiny": Workload("tiny", completion_tokens=8, steps=100, warmup_steps=10, timeout_s=600),
    "compute": Workload("compute", completion_tokens=128, steps=12, warmup_steps=2, timeout_s=900),
    "longtail": Workload("longtail", completion_tokens=512, steps=12, warmup_steps=2, timeout_s=1200),
}
LONGTAIL_FILLERS = 114
"""The long-tailed workload's vocabulary is 128 tokens: a near-uniform random policy samples EOS about once in
128 tokens, so completion lengths are geometric (median ~89, p90 ~295, a tail cut at 512)."""


@dataclass(frozen=True)
class System:
    """One configuration of the real system."""

    max_staleness: int
    generate_workers: int
    queue_maxsize: int = 16
    adaptive: bool = True  # the proxy sizes its in-flight work from the rates it measures
    inflight_versions: str = "keep"
    stale_tokens: str = "drop"
    partial_rollouts: bool = True


CONFIGS: dict[str, System] = {
    "s0": System(0, 1),
    "s2x1": System(2, 1),
    "s2x2": System(2, 2),
    # Two generate workers: the trainer is the bottleneck, so a full buffer would only age the samples.
    "s4": System(4, 2, 32),
    "s4full": System(4, 2, 32, adaptive=False),
    # In-flight updates, two generate workers, one version of staleness: tasks keep their leased version, or
    # follow new versions mid-generation (older tokens masked out, not dropped). s0x2 is their sync mode.
    "keep": System(1, 2),
    "follow": System(1, 2, inflight_versions="follow", stale_tokens="mask"),
    "s0x2": System(0, 2),
    # max_staleness = 0 following new versions: a task in flight at a publish moves onto the new version, and
    # its older tokens are masked instead of the whole rollout being dropped and sampled again.
    "follow0": System(0, 2, inflight_versions="follow", stale_tokens="mask"),
    # keep without saving partial sequences: what async.partial_rollouts costs a task that is never stopped
    "keepnp": System(1, 2, partial_rollouts=False),
}


def build_compute_model(out_dir: Path, vocab_fillers: int = 2035) -> Path:
    """A ~4.5M-parameter random-init Qwen2 and a word-level tokenizer: digits, '=', specials, fillers.

    The filler tokens never occur in prompts; they make the vocabulary large enough that EOS is rare
    under a random policy, so completions run to their length limit.
    """
    if (out_dir / "config.json").exists():
        return out_dir
    vocab = {
        token: index
        for index, token in enumerate(
            ["<eos>", "<pad>", "<unk>", *"0123456789=", *(f"<x{i}>" for i in range(vocab_fillers))]
        )
    }
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    wrapped.padding_side = "left"
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=wrapped.eos_token_id,
        pad_token_id=wrapped.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=wrapped.eos_token_id, pad_token_id=wrapped.pad_token_id)
    model.save_pretrained(out_dir)
    wrapped.save_pretrained(out_dir)
    return out_dir


def config_toml(base: str, workload: Workload, steps: int, system: System) -> str:
    return f"""\
seed = 0

[model]
base = "{base}"

[lora]
rank = 8

[dataset]
generator = "repeat_digit"
num_prompts = 512

[[rewards]]
name = "repeat_digit"

[sampling]
samples_per_prompt = 8
max_completion_length = {workload.completion_tokens}

[optimizer]
learning_rate = 3e-3
total_steps = {steps}

[loss]
loss_type = "dapo"

[async]
max_staleness = {system.max_staleness}
groups_per_task = 4
groups_per_step = 8
queue_maxsize = {system.queue_maxsize}
adaptive_inflight = {"true" if system.adaptive else "false"}
generate_task_timeout_s = 300
inflight_versions = "{system.inflight_versions}"
stale_tokens = "{system.stale_tokens}"
partial_rollouts = {"true" if system.partial_rollouts else "false"}
"""


# ---- the in-process synchronous loop ---------------------------------------------------------------------


def run_sync(config: RunConfig, steps: int, warmup_steps: int) -> dict[str, Any]:
    """Sample with the trainer's PEFT model, score, advantages, one step; repeat. Every core, no I/O."""
    torch.set_num_threads(os.cpu_count() or 1)
    trainer = Trainer.initial(Policy.load(config.model.base), config)
    prompts = build_dataset(config.dataset, config.seed)
    group = config.sampling.samples_per_prompt
    per_step = config.async_.groups_per_step
    rewards: list[float] = []
    step_times: list[float] = []
    generate_times: list[float] = []
    for step in range(steps):
        started = time.perf_counter()
        batch = [prompts[(step * per_step + i) % len(prompts)] for i in range(per_step)]
        prompt_ids = trainer.policy.encode_prompts([record["prompt"] for record in batch])
        rows = [ids for ids in prompt_ids for _ in range(group)]
        with torch.no_grad():
            trainer.model.eval()
            tokens, logprobs, _ = sample_completions(
                trainer.model,
                rows,
                max_completion_length=config.sampling.max_completion_length,
                temperature=config.sampling.temperature,
                top_p=config.sampling.top_p,
                seed=step + 1,
                eos_token_id=trainer.policy.eos_token_id,
                pad_token_id=trainer.policy.pad_token_id,
                device=trainer.policy.device,
            )
        generated = time.perf_counter()
        texts = [trainer.policy.tokenizer.decode(ids, skip_special_tokens=True) for ids in tokens]
        totals, _ = score_completions(
            config.rewards,
            [record["prompt"] for record in batch for _ in range(group)],
            texts,
            [record.get("answer") for record in batch for _ in range(group)],
        )
        advantages = group_advantages(totals, group, scale=config.loss.scale_rewards != "none").tolist()
        samples = [TrainSample(rows[i], tokens[i], logprobs[i], advantages[i]) for i in range(len(rows)) if tokens[i]]
        trainer.step(samples)
        ended = time.perf_counter()
        rewards.append(sum(totals) / len(totals))
        step_times.append(ended - started)
        generate_times.append(generated - started)
    window = step_times[warmup_steps:] or step_times
    seconds_per_step = sum(window) / len(window)
    generate_share = sum(generate_times[warmup_steps:] or generate_times) / sum(window)
    return {
        "completions_per_s": round(per_step * group / seconds_per_step, 2),
        "steps_per_s": round(1.0 / seconds_per_step, 3),
        "trainer_busy_share": round(1.0 - generate_share, 3),
        "generator_busy_share": round(generate_share, 3),
        "staleness_mean": 0.0,
        "staleness_max": 0,
        "reward_first10": _mean(rewards[:10]),
        "reward_last10": _mean(rewards[-10:]),
        "breakdown_s": {
            "generate": round(statistics.median(generate_times), 4),
            "score_and_train": round(
                statistics.median(t - g for t, g in zip(step_times, generate_times, strict=True)), 4
            ),
        },
        "threads": torch.get_num_threads(),
    }


# ---- the system ------------------------------------------------------------------------------------------


def _log_events(log_path: Path, event: str) -> list[dict[str, Any]]:
    events = []
    for line in log_path.read_text(errors="replace").splitlines():
        if f'"{event}"' not in line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == event:
            record["_end"] = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
            events.append(record)
    return events


def _busy_share(events: list[dict[str, Any]], start: float, end: float, workers: int) -> float:
    busy = 0.0
    for event in events:
        task_end = event["_end"]
        task_start = task_end - float(event["seconds"])
        busy += max(0.0, min(task_end, end) - max(task_start, start))
    return busy / max((end - start) * workers, 1e-9)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _per_task(values: list[float]) -> float | None:
    """Mean seconds per task: a cost paid on some tasks only (an adapter load) still counts."""
    return round(sum(values) / len(values), 4) if values else None


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def summarize_system(
    records: list[StepRecord], logs: Path, generate_workers: int, samples_per_step: int, warmup_steps: int
) -> dict[str, Any]:
    window = records[warmup_steps:] if len(records) > warmup_steps + 2 else records
    start, end = window[0].published_at, window[-1].published_at
    steps_per_s = (len(window) - 1) / max(end - start, 1e-9)
    optimize_events = [e for p in logs.glob("optimize-*.log") for e in _log_events(p, "optimize.task_done")]
    generate_events = [e for p in logs.glob("generate-*.log") for e in _log_events(p, "generate.task_done")]
    staleness = [s for record in window for s in record.staleness_per_sample()]
    token_means = [r.token_staleness_mean for r in window if r.token_staleness_mean is not None]
    stale_events = [e for e in generate_events if e.get("status") == "stale"]
    # Stopped mid-sampling once out of the window (stale_tokens = "drop"), sampled again under the new version.
    left_window = [e for p in logs.glob("generate-*.log") for e in _log_events(p, "generate.task_left_window")]
    rewards = [r.reward_mean for r in records if r.reward_mean is not None]
    trained_steps = [e for e in optimize_events if "step_s" in e]
    gen_timings = [e.get("timings", {}) for e in generate_events if e.get("status") == "admitted"]
    return {
        "completions_per_s": round(steps_per_s * samples_per_step, 2),
        "steps_per_s": round(steps_per_s, 3),
        "trainer_busy_share": round(_busy_share(optimize_events, start, end, 1), 3),
        "generator_busy_share": round(_busy_share(generate_events, start, end, generate_workers), 3),
        "staleness_mean": round(sum(staleness) / max(len(staleness), 1), 3),
        "staleness_max": max(staleness, default=0),
        # Per token (a sequence that followed newer versions is fresher than its rollout), over the tokens trained.
        "token_staleness_mean": round(sum(token_means) / len(token_means), 3) if token_means else None,
        "token_staleness_max": max((r.token_staleness_max or 0 for r in window), default=0),
        "masked_stale_tokens": sum(r.masked_stale_tokens or 0 for r in records),
        "completion_length_mean": _mean([r.completion_length_mean for r in window if r.completion_length_mean]),
        "versions_followed": sum(int(e.get("versions_followed", 0)) for e in generate_events),
        "partial_saves": sum(int(e.get("partial_saves", 0)) for e in generate_events),
        "tokens_resumed": sum(int(e.get("tokens_resumed", 0)) for e in generate_events),
        "reward_first10": _mean(rewards[:10]),
        "reward_last10": _mean(rewards[-10:]),
        "breakdown_s": {  # mean seconds per optimize task (trained steps) and per admitted generate task
            "optimize_task": _per_task([float(e["seconds"]) for e in trained_steps]),
            "fetch": _per_task([r.timings.fetch_s for r in window if r.timings.fetch_s is not None]),
            "rescore": _per_task([r.timings.rescore_s for r in window if r.timings.rescore_s is not None]),
            "forward_backward": _per_task([r.forward_backward_s for r in window if r.forward_backward_s]),
            "optimizer": _per_task([r.optimizer_s for r in window if r.optimizer_s]),
            "step_to_record": _per_task([r.timings.step_s for r in window if r.timings.step_s is not None]),
            "serialize": _per_task([r.timings.serialize_s for r in window if r.timings.serialize_s is not None]),
            "upload": _per_task([r.timings.upload_s for r in window if r.timings.upload_s is not None]),
            "publish": _per_task([r.timings.publish_s for r in window if r.timings.publish_s is not None]),
            "generate_task": _per_task([float(t["task_s"]) for t in gen_timings if "task_s" in t]),
            "adapter_fetch": _per_task([float(t.get("adapter_fetch_s", 0.0)) for t in gen_timings]),
            "generate": _per_task([float(t["generate_s"]) for t in gen_timings if "generate_s" in t]),
            "score": _per_task([float(t["score_s"]) for t in gen_timings if "score_s" in t]),
        },
        "generate_tasks": len(generate_events),
        "generate_tasks_stale": len(stale_events),
        # Sampled, then thrown away as stale (at submission, or at a stop out of the window): generated again.
        "regenerated_tokens": sum(int(e.get("tokens", 0)) for e in stale_events + left_window),
        "tasks_left_window": len(left_window),
    }


def run_system(
    workdir: Path,
    toml: str,
    run: str,
    generate_workers: int,
    bucket_url: str | None,
    bucket_env: dict[str, str],
    timeout_s: float,
) -> tuple[list[StepRecord], Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(
        workdir=workdir,
        run=run,
        bucket_url=bucket_url,
        extra_env={"ASYNCGRPO_LOG_FORMAT": "json", "ASYNCGRPO_LOG_LEVEL": "info", **bucket_env},
    )
    try:
        cluster.ensure_redis()
        config_path = workdir / "run.toml"
        config_path.write_text(toml)
        bucket = open_env_bucket(cluster.bucket_url)
        create_run(config_path, run, bucket)
        cluster.start_proxy()
        threads = {"ASYNCGRPO_TORCH_THREADS": "1"}  # each process one core, as the demo does
        cluster.start_worker("optimize", name="optimize-1", env=threads)
        for index in range(generate_workers):
            cluster.start_worker("generate", name=f"generate-{index + 1}", env=threads)
        deadline = time.monotonic() + timeout_s
        while True:
            cluster.check_children()
            status = cluster.status()
            if status["finished"]:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run} did not finish in {timeout_s:.0f} s: {status['current_version']}")
            time.sleep(0.5)
        records = load_step_records(bucket, run)
    finally:
        cluster.stop()
    return records, workdir / "logs"


def _bucket(kind: str, workdir: Path) -> tuple[Any, dict[str, str], Any]:
    """(url factory, env, server process) for file:// (None: the cluster's own) or a private SeaweedFS."""
    if kind == "file":
        return (lambda name: None), {}, None
    from tests.support.fixtures_s3 import start_seaweedfs

    process, endpoint = start_seaweedfs(workdir / "seaweedfs")
    return (lambda name: endpoint.bucket_url(name)), endpoint.env(), process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="tiny,compute")
    parser.add_argument("--configs", default="sync,s0,s2x1,s2x2,s4,s4full")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: per workload)")
    parser.add_argument("--bucket", choices=["file", "seaweedfs"], default="file")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and buckets here")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    bucket_url, bucket_env, server = _bucket(args.bucket, workdir)
    os.environ.setdefault("ASYNCGRPO_CACHE", str(workdir / "cache"))
    results: list[dict[str, Any]] = []
    try:
        for workload_name in args.workloads.split(","):
            workload = WORKLOADS[workload_name]
            steps = args.steps or workload.steps
            if workload_name == "tiny":
                base = str(ensure_tiny_model(cache_dir=workdir / "cache"))
            elif workload_name == "longtail":
                base = str(build_compute_model(workdir / "longtail-model", vocab_fillers=LONGTAIL_FILLERS))
            else:
                base = str(build_compute_model(workdir / "compute-model"))
            for name in args.configs.split(","):
                system = CONFIGS.get(name, System(0, 0))
                gen_workers = system.generate_workers
                toml = config_toml(base, workload, steps, system)
                started = time.monotonic()
                if name == "sync":
                    path = workdir / f"{workload_name}-sync.toml"
                    path.write_text(toml)
                    figures = run_sync(load_run_config(path), steps, workload.warmup_steps)
                    line: dict[str, Any] = {"workload": workload_name, "config": "sync", **figures}
                else:
                    run = f"{workload_name}-{name}"
                    records, logs = run_system(
                        workdir / run, toml, run, gen_workers, bucket_url(run), bucket_env, workload.timeout_s
                    )
                    line = {
                        "workload": workload_name,
                        "config": name,
                        "max_staleness": system.max_staleness,
                        "generate_workers": gen_workers,
                        "inflight_versions": system.inflight_versions,
                        "stale_tokens": system.stale_tokens,
                        "partial_rollouts": system.partial_rollouts,
                        "bucket": args.bucket,
                        **summarize_system(records, logs, gen_workers, 64, workload.warmup_steps),
                    }
                line["steps"] = steps
                line["wall_s"] = round(time.monotonic() - started, 1)
                results.append(line)
                print(json.dumps(line), flush=True)
    finally:
        if server is not None:
            server.terminate()
    print(json.dumps({"ratios": ratios(results), "cpus": os.cpu_count(), "workdir": str(workdir)}), flush=True)


def ratios(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's comparisons, per workload, from this run's lines."""
    out: dict[str, Any] = {}
    for workload in sorted({r["workload"] for r in results}):
        by_config = {r["config"]: r for r in results if r["workload"] == workload}

        def rate(config: str, lines: dict[str, dict[str, Any]] = by_config) -> float | None:
            return lines[config]["completions_per_s"] if config in lines else None

        figures: dict[str, Any] = {}
        for config in ("s2x1", "s2x2"):
            for reference in ("s0", "sync"):
                if rate(config) and rate(reference):
                    figures[f"{config}_over_{reference}"] = round(rate(config) / rate(reference), 3)
        pairs = (
            ("follow", "keep"),
            ("follow", "s0x2"),
            ("keep", "s0x2"),
            ("follow0", "s0x2"),
            ("follow", "sync"),
            ("keep", "keepnp"),
        )
        for config, reference in pairs:
            if rate(config) and rate(reference):
                figures[f"{config}_over_{reference}"] = round(rate(config) / rate(reference), 3)
        if rate("s4") and rate("s4full"):
            figures["s4_throughput_over_s4full"] = round(rate("s4") / rate("s4full"), 3)
            figures["s4_staleness_mean"] = by_config["s4"]["staleness_mean"]
            figures["s4full_staleness_mean"] = by_config["s4full"]["staleness_mean"]
        out[workload] = figures
    return out


if __name__ == "__main__":
    main()
