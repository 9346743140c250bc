"""``asyncgrpo status [--watch]``: a run at a glance, for a person at a terminal.

From the proxy (``GET /v1/status`` and ``GET /v1/workers``): current version, step in flight, buffer and
in-flight groups, counters, leases, and every worker with its last heartbeat. From the bucket (when given):
the run config's limits and the last step records, for the reward trend, staleness and step times.

``collect_status`` gathers a ``StatusSnapshot``; ``render_status`` turns one into rich renderables (pure,
so it is tested without a terminal); ``show_status`` prints once or refreshes in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from asyncgrpo.bucket.backends import Bucket, BucketError
from asyncgrpo.protocol.client import ProxyClient, ProxyError
from asyncgrpo.protocol.records import StepRecord
from asyncgrpo.protocol.schemas import StatusResponse, WorkerRecord
from asyncgrpo.run.config import RunConfig
from asyncgrpo.run.creation import load_run
from cli.history import load_step_records

log = structlog.get_logger()

SPARK_CHARS = "▁▂▃▄▅▆▇█"
RECENT_STEPS = 30


@dataclass
class StatusSnapshot:
    status: StatusResponse
    workers: list[WorkerRecord]
    records: list[StepRecord] = field(default_factory=list)
    config: RunConfig | None = None
    taken_at: float = field(default_factory=time.time)
    bucket_error: str | None = None


def collect_status(
    client: ProxyClient, bucket: Bucket | None = None, *, recent_steps: int = RECENT_STEPS
) -> StatusSnapshot:
    """Ask the proxy, then read the run's config and last step records from the bucket (when given)."""
    status = client.status()
    workers = client.workers()
    snapshot = StatusSnapshot(status=status, workers=workers)
    if bucket is not None:
        try:
            snapshot.config, _, _ = load_run(bucket, status.run)
            snapshot.records = load_step_records(bucket, status.run, last=recent_steps)
        except BucketError as error:
            # The proxy's view is still worth showing when the bucket is unreachable from this terminal.
            snapshot.bucket_error = f"{type(error).__name__}: {error}"
            log.warning("tools.status_bucket_unreadable", error=str(error))
    return snapshot


def sparkline(values: list[float]) -> str:
    """One character per value, scaled between the smallest and largest."""
    if not values:
        return ""
    low, high = min(values), max(values)
    if high == low:
        return SPARK_CHARS[len(SPARK_CHARS) // 2] * len(values)
    scale = (len(SPARK_CHARS) - 1) / (high - low)
    return "".join(SPARK_CHARS[round((v - low) * scale)] for v in values)


def _age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _fmt(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}g}"


def _present(values: list[float | None]) -> list[float]:
    """The figures the records have (a mean over nothing is None)."""
    return [float(value) for value in values if value is not None]


def _run_table(snapshot: StatusSnapshot) -> Table:
    status = snapshot.status
    config = snapshot.config
    table = Table(title=f"run {status.run}", show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    version = "none yet" if status.current_version < 0 else f"v{status.current_version}"
    table.add_row("version", version)
    if status.halted:
        table.add_row("HALTED", Text(status.halted, style="bold red"))
    table.add_row("step in flight", "-" if status.step_inflight is None else str(status.step_inflight))
    if config is not None:
        table.add_row("lr schedule", f"{config.optimizer.total_steps} steps ({config.optimizer.lr_schedule})")
    table.add_row("epoch", f"{status.epoch} (position {status.epoch_pos})")
    capacity = f" / {config.async_.queue_maxsize}" if config is not None else ""
    table.add_row(
        "buffer (groups)",
        f"{status.groups_buffered} admitted, {status.groups_inflight} generating{capacity}; "
        f"{status.groups_requeued} requeued; {status.tasks_inflight} tasks in flight",
    )
    alive = ", ".join(f"{role}: {count}" for role, count in sorted(status.workers_alive_by_role.items()))
    table.add_row("workers alive", alive or "none")
    if status.fleet is not None:
        fleet = status.fleet
        table.add_row(
            "generators wanted",
            f"{fleet.wanted} ({fleet.submitting} submitting; {fleet.tasks_per_version} tasks per version, "
            f"task {fleet.task_s:.2f} s, step {fleet.step_s:.2f} s)",
        )
    leased = sorted({lease.version for lease in status.leases})
    table.add_row("leases", f"{len(status.leases)} active" + (f" on versions {leased}" if leased else ""))
    counters = status.counters
    table.add_row(
        "groups",
        f"trained {counters.get('groups_trained', 0)}, admitted {counters.get('groups_admitted', 0)}, "
        f"stale drops {counters.get('groups_stale', 0)}, rejected {sum(status.rejected_by_reason.values())}",
    )
    table.add_row(
        "events",
        f"leases expired {counters.get('leases_expired', 0)}, tasks lost {counters.get('tasks_cancelled', 0)}, "
        f"publish conflicts {counters.get('conflicts', 0)}, steps re-sent {counters.get('optimize_resent', 0)}, "
        f"un-claimed {counters.get('steps_unclaimed', 0)}",
    )
    for reason, count in sorted(status.rejected_by_reason.items()):
        table.add_row("  rejected", f"{count} × {reason}")
    if status.eval_latest is not None or status.evals_pending:
        table.add_row("eval", eval_line(status))
    return table


def eval_line(status: StatusResponse) -> str:
    """The newest evaluation ([eval]): its version, reward and pass@k, and how many versions wait for one."""
    pending = f"{status.evals_pending} version(s) pending"
    latest = status.eval_latest
    if latest is None:
        return f"none yet; {pending}"
    figures = [f"reward {_fmt(latest.metrics['reward'])}"] if "reward" in latest.metrics else []
    passes = sorted((key for key in latest.metrics if key.startswith("pass@")), key=lambda key: int(key[5:]))
    figures += [f"{key} {_fmt(latest.metrics[key])}" for key in passes]
    return f"v{latest.version}: {', '.join(figures) or 'no scored prompt'}; {pending}"


def _trend_table(snapshot: StatusSnapshot) -> RenderableType:
    records = snapshot.records
    if snapshot.bucket_error:
        return Text(f"step records unavailable: {snapshot.bucket_error}", style="yellow")
    if not records:
        return Text("no step records yet", style="dim")
    table = Table(title=f"last {len(records)} steps", title_justify="left", box=None, pad_edge=False)
    table.add_column("figure", style="bold")
    table.add_column("trend")
    table.add_column("first", justify="right")
    table.add_column("last", justify="right")
    limit = snapshot.config.async_.max_staleness if snapshot.config is not None else None
    staleness_label = "max staleness" + (f" (limit {limit})" if limit is not None else "")
    rows = [
        ("reward mean", _present([r.reward_mean for r in records])),
        ("ratio", _present([r.ratio for r in records])),
        ("kl (k3)", _present([r.kl for r in records])),
        ("completion length", _present([r.completion_length_mean for r in records])),
        (staleness_label, _present([r.max_staleness for r in records])),
        ("step seconds", _present([r.timings.step_s for r in records])),
    ]
    for name, values in rows:
        if values:
            table.add_row(name, sparkline(values), _fmt(values[0]), _fmt(values[-1]))
    flagged = sum(len(r.flagged_rollouts) for r in records)
    if flagged:
        table.add_row("ratio-flagged rollouts", Text(str(flagged), style="red"), "", "")
    last = records[-1]
    table.add_row("last step", f"step {last.step}, {_age(snapshot.taken_at - last.published_at)}", "", "")
    return table


def _workers_table(snapshot: StatusSnapshot) -> Table:
    table = Table(title="workers", title_justify="left")
    for column in ("worker", "role", "state", "host", "versions", "task", "heartbeat"):
        table.add_column(column)
    for worker in sorted(snapshot.workers, key=lambda w: (w.role, w.worker_id)):
        heartbeat = Text(_age(snapshot.taken_at - worker.last_seen), style="green" if worker.alive else "red")
        if not worker.alive:
            heartbeat.append(" (dead)")
        versions = ",".join(f"v{v}" for v in worker.versions_cached[-4:]) or "-"
        table.add_row(
            worker.worker_id,
            worker.role,
            worker.state,
            f"{worker.hostname}:{worker.pid}",
            versions,
            worker.current_task or "-",
            heartbeat,
        )
    if not snapshot.workers:
        table.add_row("(none)", "", "", "", "", "", "")
    return table


def render_status(snapshot: StatusSnapshot) -> Group:
    """The whole view of one snapshot."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.taken_at))
    return Group(
        Text(f"asyncgrpo status at {stamp}", style="bold"),
        _run_table(snapshot),
        Text(""),
        _trend_table(snapshot),
        Text(""),
        _workers_table(snapshot),
    )


def show_status(
    client: ProxyClient,
    bucket: Bucket | None,
    *,
    watch: bool = False,
    interval_s: float = 2.0,
    console: Console | None = None,
    max_refreshes: int | None = None,
) -> None:
    """Print the status once, or with ``watch`` refresh it in place every ``interval_s`` until Ctrl-C."""
    console = console or Console()
    if not watch:
        console.print(render_status(collect_status(client, bucket)))
        return
    refreshes = 0
    with Live(_watch_frame(client, bucket), console=console, auto_refresh=False) as live:
        try:
            while max_refreshes is None or refreshes < max_refreshes:
                time.sleep(interval_s)
                live.update(_watch_frame(client, bucket), refresh=True)
                refreshes += 1
        except KeyboardInterrupt:
            return


def _watch_frame(client: ProxyClient, bucket: Bucket | None) -> RenderableType:
    # While watching, a proxy restart is something to show, not a reason to exit.
    try:
        return render_status(collect_status(client, bucket))
    except ProxyError as error:
        stamp = time.strftime("%H:%M:%S")
        return Text(f"{stamp} proxy unreachable: {error}; retrying", style="red")
