"""``asyncgrpo demo``: the whole system on one machine, on the tiny model and the toy task.

Starts Redis (or reuses the one ASYNCGRPO_REDIS_URL names, under a run name of its own, so another demo there
keeps its own state and queues), keeps a ``file://`` bucket in a work folder, creates the run from the
embedded default config, and runs the proxy, ``generate_workers`` generate workers and one optimize worker as
separate real processes. Shows live progress, ends with a summary (``--json``: one JSON line), and stops every
child on the way out, Ctrl-C included.
"""

from __future__ import annotations

import json
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from proxy.protocol.log_setup import configure_logging
from proxy.protocol.records import StepRecord
from proxy.protocol.schemas import StatusResponse
from proxy.protocol.settings import CommonSettings
from proxy.run.store import create_run
from proxy.storage import bucket_keys
from proxy.storage.bucket import open_bucket
from worker.tools.local_cluster import ClusterError, LocalCluster
from worker.tools.step_records import load_step_records

RUN_NAME = "demo"
DEFAULT_STEPS = 200
SAMPLES_PER_PROMPT = 8
# The toy task on the tiny model; every other field keeps RunConfig's defaults (see examples/demo.toml).
DEMO_CONFIG_TOML = """\
seed = 0

[model]
base = "tiny"

[dataset]
generator = "repeat_digit"
num_prompts = 512

[[rewards]]
name = "repeat_digit"

[sampling]
samples_per_prompt = {samples_per_prompt}

[optimizer]
total_steps = {steps}

[async]
max_staleness = 2
groups_per_task = 4
groups_per_step = 8
queue_maxsize = 16
generate_task_timeout_s = 120
"""


def summarize(
    records: list[StepRecord], status: StatusResponse, wall_s: float, samples_per_prompt: int
) -> dict[str, Any]:
    """The demo's closing figures (the one JSON line of ``--json``)."""
    rewards = [r.reward_mean for r in records if r.reward_mean is not None]
    first, last = rewards[:10], rewards[-10:]
    groups_stale = status.counters.get("groups_stale", 0)
    return {
        "steps": len(records),
        "versions_published": status.current_version + 1,
        "reward_first10": round(sum(first) / len(first), 4) if first else None,
        "reward_last10": round(sum(last) / len(last), 4) if last else None,
        "max_staleness_trained": max((r.max_staleness for r in records), default=0),
        "samples_trained": sum(r.samples for r in records),
        "samples_dropped_stale": groups_stale * samples_per_prompt,
        "groups_dropped_stale": groups_stale,
        "mean_rescore_ratio": round(sum(r.rescore_ratio or 0.0 for r in records) / max(1, len(records)), 6),
        "flagged_rollouts": sum(len(r.flagged_rollouts) for r in records),
        "wall_s": round(wall_s, 1),
    }


def _progress_table(records: list[StepRecord], status: StatusResponse, started: float) -> Table:
    table = Table(title="asyncgrpo demo", show_lines=False)
    for column in ("step", "version", "reward", "staleness", "tokens/s", "buffered", "in flight", "workers"):
        table.add_column(column)
    last = records[-1] if records else None
    elapsed = max(time.monotonic() - started, 1e-6)
    tokens = sum(r.tokens for r in records)
    workers = status.workers_alive_by_role
    table.add_row(
        str(last.step) if last else "-",
        str(status.current_version),
        f"{last.reward_mean:.3f}" if last and last.reward_mean is not None else "-",
        str(last.max_staleness) if last else "-",
        f"{tokens / elapsed:.0f}",
        str(status.groups_buffered),
        str(status.groups_inflight),
        ", ".join(f"{role}={count}" for role, count in sorted(workers.items())) or "-",
    )
    return table


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_on_signals() -> None:
    """Ctrl-C, SIGTERM and SIGHUP all end the demo through its clean-up path (children live in their own
    sessions, so they would outlive a demo killed by a default signal action). SIGINT is set explicitly: a
    shell that starts a background job leaves it ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)


def run_demo(*, steps: int | None, as_json: bool, workdir: Path | None, generate_workers: int) -> int:
    steps = steps or DEFAULT_STEPS
    # Log lines go to stderr: with --json, stdout carries the one summary line and nothing else.
    configure_logging(stream=sys.stderr, role="demo")
    console = Console(stderr=as_json)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="asyncgrpo-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # A Redis named in ASYNCGRPO_REDIS_URL is reused; otherwise the cluster starts a private redis-server.
    settings = CommonSettings()
    redis_url = settings.redis_url if "redis_url" in settings.model_fields_set else None
    # On a reused Redis the run gets a name of its own (its Celery queues and Redis keys are named after it).
    run_name = RUN_NAME if redis_url is None else f"{RUN_NAME}-{secrets.token_hex(3)}"
    cluster = LocalCluster(workdir=workdir, run=run_name, redis_url=redis_url)
    _stop_on_signals()
    started = time.monotonic()
    try:
        cluster.ensure_redis()
        config_path = workdir / "demo.toml"
        config_path.write_text(DEMO_CONFIG_TOML.format(steps=steps, samples_per_prompt=SAMPLES_PER_PROMPT))
        bucket = open_bucket(cluster.bucket_url)
        create_run(config_path, run_name, bucket)
        console.print(f"work folder: {workdir}  redis: {cluster.redis_url}  run: {run_name}")
        cluster.start_proxy()
        # Two cores here: one torch thread per process keeps the processes from fighting over them.
        threads = {"ASYNCGRPO_TORCH_THREADS": "1"}
        cluster.start_worker("optimize", env=threads)
        for _ in range(generate_workers):
            cluster.start_worker("generate", env=threads)
        with Live(console=console, refresh_per_second=2, transient=as_json) as live:
            while True:
                cluster.check_children()
                status = StatusResponse.model_validate(cluster.status())
                records = load_step_records(bucket, run_name)
                live.update(_progress_table(records, status, started))
                if status.finished and len(records) >= status.final_version:
                    break
                time.sleep(1.0)
        summary = summarize(records, status, time.monotonic() - started, SAMPLES_PER_PROMPT)
    except ClusterError as error:
        console.print(f"[red]demo failed:[/red] {error}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted; stopping every process")
        return 130
    finally:
        cluster.stop()
    if as_json:
        # The one machine-readable line the CLI promises, on stdout (progress went to stderr).
        sys.stdout.write(json.dumps(summary) + "\n")
        sys.stdout.flush()
    else:
        table = Table(title="demo summary")
        table.add_column("figure")
        table.add_column("value")
        for key, value in summary.items():
            table.add_row(key, str(value))
        console.print(table)
        console.print(f"step records: {workdir / 'bucket' / bucket_keys.metrics_prefix(run_name)}")
    return 0
