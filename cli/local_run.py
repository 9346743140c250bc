"""``asyncgrpo local CONFIG``: any run config on one machine, as separate real processes.

Creates the run from the config (a run that already exists with the same config and prompts is resumed: the
proxy rebuilds its state from the bucket), then runs Redis (a private ``redis-server``, or the one
ASYNCGRPO_REDIS_URL names), the proxy, one optimize worker and ``generate_workers`` generate workers. The
bucket is ASYNCGRPO_BUCKET when set, else a ``file://`` bucket in the work folder. Shows live progress, ends
with a summary (``--json``: one JSON line on stdout), and stops every child on the way out (Ctrl-C, SIGTERM
and SIGHUP included). ``asyncgrpo demo`` is this on an embedded config (``cli.demo``).

Nothing is started before the config is valid and the run is stored, so a bad config leaves no process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError, open_bucket
from asyncgrpo.bucket.layout import IntegrityError
from asyncgrpo.protocol.log_setup import configure_logging
from asyncgrpo.protocol.records import StepRecord
from asyncgrpo.protocol.schemas import StatusResponse
from asyncgrpo.protocol.settings import CommonSettings
from asyncgrpo.run.config import load_run_config
from asyncgrpo.run.creation import RunExistsError, create_run
from cli.history import load_step_records
from cli.local_cluster import ClusterError, LocalCluster, redis_reachable
from proxy.coordinator.redis_store import RunKeys
from worker.generate.agent import check_agent_of
from worker.model.reward_models import check_reward_models_of
from worker.process.settings import WorkerSettings

# Exit codes: 2 for input to change (the config, the run name), 1 for a process that failed, 130 for Ctrl-C.
EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


class ForeignRunState(Exception):
    """A shared Redis holds state of a run of this name that the bucket does not know."""


# What the user must fix: the config, the run name, the bucket, a variable (ConfigError, PromptFileError, a bad
# run name and SettingsError are ValueErrors).
INPUT_ERRORS = (ValueError, RunExistsError, ForeignRunState, BucketError, IntegrityError)


def configured_services(settings: CommonSettings) -> tuple[str | None, str | None]:
    """The Redis URL and the bucket the environment names (ASYNCGRPO_REDIS_URL, ASYNCGRPO_BUCKET), None
    where unset (the local run then starts a private redis-server, or keeps a bucket in its work folder)."""
    redis_url = settings.redis_url if "redis_url" in settings.model_fields_set else None
    # Set by the user, not a settings class's default (a worker's own default bucket is not this run's).
    bucket = settings.bucket if "bucket" in settings.model_fields_set else None
    return redis_url, bucket


def torch_threads_env(worker_processes: int, settings: WorkerSettings) -> dict[str, str]:
    """ASYNCGRPO_TORCH_THREADS for the workers: the machine's cores split evenly between the worker processes
    (oversubscribed cores make every process slower), unless the user set it. On a GPU the threads matter
    little; on a 2-core machine this is 1 thread each."""
    if "torch_threads" in settings.model_fields_set:
        return {}  # the children inherit the user's value
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"ASYNCGRPO_TORCH_THREADS": str(max(1, cores // max(1, worker_processes)))}


def summarize(
    records: list[StepRecord], status: StatusResponse, wall_s: float, samples_per_prompt: int
) -> dict[str, Any]:
    """The closing figures of a local run (the one JSON line of ``--json``)."""
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
        # The newest evaluation ([eval]); None when the run evaluates nothing.
        "eval_version": status.eval_latest.version if status.eval_latest else None,
        "eval_reward": round(status.eval_latest.metrics["reward"], 4)
        if status.eval_latest and "reward" in status.eval_latest.metrics
        else None,
        "wall_s": round(wall_s, 1),
    }


def run_done(status: StatusResponse, records: list[StepRecord]) -> bool:
    """Whether the run is over and the summary may be written: the proxy says it finished, every step's record
    is in the bucket, and no evaluation ([eval]) is due (the final version's included)."""
    return status.finished and len(records) >= status.final_version and status.evals_pending == 0


def progress_table(
    title: str, records: list[StepRecord], status: StatusResponse, started: float, records_before: int
) -> Table:
    """One row of live figures; tokens/s counts only the steps taken since this command started (a resumed
    run's earlier steps are not this session's throughput)."""
    table = Table(title=title, show_lines=False, caption=f"halted: {status.halted}" if status.halted else None)
    for column in ("step", "version", "reward", "staleness", "tokens/s", "buffered", "in flight", "workers"):
        table.add_column(column)
    last = records[-1] if records else None
    elapsed = max(time.monotonic() - started, 1e-6)
    tokens = sum(r.tokens for r in records[records_before:])
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
    """Ctrl-C, SIGTERM and SIGHUP all end the run through its clean-up path (children live in their own
    sessions, so they would outlive a parent killed by a default signal action). SIGINT is set explicitly: a
    shell that starts a background job leaves it ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)


def _refuse_foreign_redis_state(redis_url: str, run_name: str, bucket: Bucket) -> None:
    """A run new to the bucket must not meet state of the same name in a shared Redis: the proxy would take
    that state (of a run kept in another bucket) for its own."""
    if not redis_reachable(redis_url):
        return  # the local run starts a private Redis instead
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=2)
    try:
        taken = client.exists(RunKeys(run_name).state)
    finally:
        client.close()
    if taken:
        raise ForeignRunState(
            f"Redis at {redis_url} already holds the state of a run named {run_name!r}, but {bucket.url} has no "
            "such run; pick another --run name (or unset ASYNCGRPO_REDIS_URL to use a private Redis)"
        )


def _create_or_resume(config_path: Path, run_name: str, bucket: Bucket, redis_url: str | None) -> bool:
    """Store the run; True when it was there already (same config and prompts: it is resumed)."""
    existed = bucket.head(bucket_keys.run_manifest_key(run_name)) is not None
    if not existed and redis_url:
        _refuse_foreign_redis_state(redis_url, run_name, bucket)
    check_reward_models_of(config_path)
    check_agent_of(config_path)
    create_run(config_path, run_name, bucket)
    return existed


def _print_error(prefix: str, error: BaseException) -> None:
    # Plain text, not rich: a config error names fields like `[async]`, which rich would take for markup.
    sys.stderr.write(f"{prefix}: {error}\n")
    sys.stderr.flush()


def run_local(
    config_path: Path,
    *,
    run_name: str,
    workdir: Path,
    generate_workers: int,
    as_json: bool,
    redis_url: str | None,
    bucket_url: str | None,
    title: str,
    settings: WorkerSettings,
) -> int:
    """Run ``config_path`` as run ``run_name`` on this machine until it finishes; return the exit code.

    ``redis_url``/``bucket_url`` None: a private redis-server, a ``file://`` bucket in ``workdir``. ``settings``:
    this command's environment, parsed once by the command line."""
    # Log lines go to stderr: with --json, stdout carries the one summary line and nothing else.
    configure_logging(log_format=settings.log_format, level=settings.log_level, stream=sys.stderr, role="local")
    console = Console(stderr=as_json)
    workdir.mkdir(parents=True, exist_ok=True)
    # Set first: a Ctrl-C from here on goes through the clean-up below.
    _stop_on_signals()
    started = time.monotonic()
    bucket_url = bucket_url or f"file://{workdir.resolve() / 'bucket'}"
    cluster = LocalCluster(workdir=workdir, run=run_name, redis_url=redis_url, bucket_url=bucket_url)
    try:
        try:
            # The config and the run first: nothing is started for a config that cannot run.
            samples_per_prompt = load_run_config(config_path).sampling.samples_per_prompt
            bucket = open_bucket(bucket_url, s3_endpoint_url=settings.s3_endpoint_url)
            resumed = _create_or_resume(config_path, run_name, bucket, redis_url)
            threads = torch_threads_env(1 + generate_workers, settings)
        except INPUT_ERRORS as error:
            _print_error(f"asyncgrpo: cannot run {config_path}", error)
            return EXIT_BAD_INPUT
        cluster.ensure_redis()
        console.print(
            f"{'resuming' if resumed else 'new'} run: {run_name}  work folder: {cluster.workdir}  "
            f"redis: {cluster.redis_url}  bucket: {bucket_url}",
            markup=False,
            soft_wrap=True,  # one line, whatever the width: paths are copied from it
        )
        cluster.start_proxy()
        cluster.start_worker("optimize", env=threads)
        for _ in range(generate_workers):
            cluster.start_worker("generate", env=threads)
        records_before: int | None = None
        with Live(console=console, refresh_per_second=2, transient=as_json) as live:
            while True:
                cluster.check_children()
                status = StatusResponse.model_validate(cluster.status())
                records = load_step_records(bucket, run_name)
                records_before = len(records) if records_before is None else records_before
                live.update(progress_table(title, records, status, started, records_before))
                if run_done(status, records):
                    break
                time.sleep(1.0)
        summary = summarize(records, status, time.monotonic() - started, samples_per_prompt)
    except ClusterError as error:
        _print_error(f"{title} failed", error)
        return EXIT_FAILED
    except KeyboardInterrupt:
        console.print("interrupted; stopping every process")
        return EXIT_INTERRUPTED
    finally:
        cluster.stop()
    if as_json:
        # The one machine-readable line the CLI promises, on stdout (progress went to stderr).
        sys.stdout.write(json.dumps(summary) + "\n")
        sys.stdout.flush()
    else:
        table = Table(title=f"{title}: summary")
        table.add_column("figure")
        table.add_column("value")
        for key, value in summary.items():
            table.add_row(key, str(value))
        console.print(table)
        console.print(
            f"step records: {bucket_url}/{bucket_keys.metrics_prefix(run_name)}", markup=False, soft_wrap=True
        )
    return 0
