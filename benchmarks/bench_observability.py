"""What observability costs a worker: recording one task or step, one scrape, one plot, one status read.

    python benchmarks/bench_observability.py [--samples 1024] [--steps 1000]

Prints figures; asserts nothing. The step record is a real one (``optimize_job._step_record``) of
``--samples`` completions in 64 rollouts.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import generate_latest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import open_bucket
from asyncgrpo.protocol.records import GenerateTimings, StepRecord, StepTimings, UpdateMetrics
from asyncgrpo.protocol.schemas import GroupRef
from cli.history import load_step_records
from cli.plot import plot_run
from worker.algo.rollout import Rollout, RolloutSample
from worker.generate.job import GenerateResult
from worker.optimize.job import build_step_record
from worker.process import metrics as worker_metrics


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median, max) seconds of ``repeat`` calls."""
    runs = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs), max(runs)


def make_record(step: int, samples: int) -> StepRecord:
    per_rollout = max(samples // 64, 1)
    rollouts = [
        Rollout(
            "bench",
            f"t{step}-{i}",
            max(step - 1 - i % 3, 0),
            "gen-1",
            [GroupRef(group_id=f"g{step}-{i}", prompt_index=i)],
            [
                RolloutSample(0, [1] * 32, [2] * 128, [-0.5] * 128, 0.5, 0.0, "stop", {"r": 0.5})
                for _ in range(per_rollout)
            ],
        )
        for i in range(64)
    ]
    update = UpdateMetrics(
        update=step,
        loss=0.1,
        ratio=1.0,
        kl=0.001,
        clip_low=0.0,
        clip_high=0.01,
        clip_region=0.01,
        entropy=1.0,
        grad_norm=0.5,
        lr=1e-3,
        tokens=samples * 128,
        sequences=samples,
        micro_batches=8,
        forward_backward_s=1.0,
        optimizer_s=0.1,
    )
    record = build_step_record(
        run="bench",
        step=step,
        base_version=step - 1,
        worker_id="trainer-1",
        rollouts=rollouts,
        ratios=[1.0] * 64,
        flagged=[],
        updates=[update],
        timings=StepTimings(step_s=2.0, fetch_s=0.1, rescore_s=0.3, upload_s=0.05),
    )
    record.published_at = 1_700_000_000.0 + step
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024, help="completions per optimize step")
    parser.add_argument("--steps", type=int, default=1000, help="step records to plot")
    args = parser.parse_args()

    record = make_record(10, args.samples)
    result = GenerateResult(
        "t1",
        "admitted",
        9,
        4,
        32,
        4096,
        False,
        GenerateTimings(adapter_fetch_s=0.01, generate_s=2.0, score_s=0.1, task_s=2.5),
        0.5,
    )

    median, worst = timed(lambda: worker_metrics.observe_generate_task(result), 2000)
    print(f"observe_generate_task: median {median * 1e6:.1f} us, max {worst * 1e6:.1f} us")
    median, worst = timed(lambda: worker_metrics.observe_optimize_step(record, "published"), 200)
    print(f"observe_optimize_step ({record.samples} samples): median {median * 1e3:.3f} ms, max {worst * 1e3:.3f} ms")
    body = generate_latest(worker_metrics.REGISTRY)
    median, worst = timed(lambda: generate_latest(worker_metrics.REGISTRY), 200)
    print(f"worker /metrics render ({len(body)} bytes): median {median * 1e3:.3f} ms, max {worst * 1e3:.3f} ms")

    with tempfile.TemporaryDirectory() as tmp:
        bucket = open_bucket(f"file://{tmp}/bucket")
        small = make_record(1, 64).model_dump_json().encode()
        for step in range(1, args.steps + 1):
            bucket.put(bucket_keys.metrics_key("bench", step), small)
        started = time.perf_counter()
        records = load_step_records(bucket, "bench", last=30)
        print(
            f"status: read last {len(records)} of {args.steps} step records: "
            f"{(time.perf_counter() - started) * 1e3:.1f} ms (file bucket)"
        )
        started = time.perf_counter()
        plot_run(bucket, "bench", Path(tmp) / "plot.png")
        print(
            f"plot of {args.steps} steps: {time.perf_counter() - started:.2f} s "
            f"({(Path(tmp) / 'plot.png').stat().st_size} bytes)"
        )


if __name__ == "__main__":
    main()
