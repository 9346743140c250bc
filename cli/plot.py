"""``asyncgrpo plot``: one PNG of a run's reward, ratio, staleness and throughput against the step, and with
``[eval]`` a panel of the eval reward and pass@k against the version.

Built from the step and eval records in the bucket (``runs/<run>/metrics/``, ``runs/<run>/evals/``), so it
works on a finished run, a live one, or a copy of its bucket, without the proxy. Needs the ``plot`` extra
(matplotlib); draws with the Agg backend, so no display is needed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import structlog

from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.protocol.records import EvalRecord, StepRecord
from cli.history import load_eval_records, load_step_records

log = structlog.get_logger()


class PlotError(ValueError):
    """Nothing to plot, or no way to plot it; the message says what to do."""


def _value(value: float | None) -> float:
    """A figure to draw; a missing one (a mean over nothing) leaves a gap."""
    return math.nan if value is None else float(value)


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else math.nan


def _throughput_series(records: list[StepRecord]) -> tuple[list[float], list[float]]:
    """(trainer tokens/s of step compute, run tokens/s of wall clock between publishes) per record."""
    compute, wall = [], []
    previous_time: float | None = None
    for record in records:
        step_s = record.timings.step_s
        compute.append(record.tokens / step_s if step_s else math.nan)
        published = record.published_at
        if previous_time is not None and published > previous_time:
            wall.append(record.tokens / (published - previous_time))
        else:
            wall.append(math.nan)
        previous_time = published
    return compute, wall


EVAL_PANEL_TITLE = "eval on held-out prompts, per version"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise PlotError("plotting needs matplotlib: pip install 'asyncgrpo[plot]'") from error
    return plt


def plot_records(records: list[StepRecord], out: Path, title: str = "", evals: list[EvalRecord] | None = None) -> Path:
    """Draw ``records`` (step records, any order), and ``evals`` when there are any, into the PNG ``out``."""
    plt = _pyplot()
    figure = draw_records(records, title, evals)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)
    log.info("tools.plot_written", path=str(out), steps=len(records), evals=len(evals or []))
    return out


def draw_records(records: list[StepRecord], title: str = "", evals: list[EvalRecord] | None = None) -> Any:
    """The matplotlib figure ``plot_records`` saves: four panels against the step, a fifth for ``evals``."""
    if not records:
        raise PlotError("there are no step records to plot yet; wait for the first published step")
    plt = _pyplot()
    records = sorted(records, key=lambda r: r.step)
    steps = [r.step for r in records]
    layout = [["reward", "ratio"], ["staleness", "throughput"]] + ([["eval", "eval"]] if evals else [])
    figure, panels = plt.subplot_mosaic(layout, figsize=(12, 4 * len(layout)))
    reward_ax, ratio_ax, staleness_ax, throughput_ax = (
        panels[name] for name in ("reward", "ratio", "staleness", "throughput")
    )
    for ax in (ratio_ax, staleness_ax, throughput_ax):
        ax.sharex(reward_ax)

    reward_mean = [_value(r.reward_mean) for r in records]
    reward_std = [_value(r.reward_std) for r in records]
    reward_ax.plot(steps, reward_mean, label="reward mean", color="tab:blue")
    low = [m - s if not math.isnan(s) else m for m, s in zip(reward_mean, reward_std, strict=True)]
    high = [m + s if not math.isnan(s) else m for m, s in zip(reward_mean, reward_std, strict=True)]
    reward_ax.fill_between(steps, low, high, alpha=0.2, color="tab:blue", label="± std")
    names = sorted({name for r in records for name in r.rewards_by_name})
    if len(names) > 1:
        for name in names:
            reward_ax.plot(steps, [_value(r.rewards_by_name.get(name)) for r in records], label=name, linewidth=0.8)
    reward_ax.set_ylabel("reward")
    reward_ax.set_title("reward")
    reward_ax.legend(loc="best", fontsize="small")

    ratio_ax.plot(steps, [_value(r.ratio) for r in records], label="ratio (train)", color="tab:green")
    ratio_ax.plot(
        steps, [_value(r.rescore_ratio) for r in records], label="ratio (rescore)", color="tab:olive", linestyle="--"
    )
    ratio_ax.axhline(1.0, color="grey", linewidth=0.8)
    ratio_ax.set_title("importance ratio π/π_behaviour")
    ratio_ax.legend(loc="best", fontsize="small")

    staleness_ax.plot(steps, [_mean(r.staleness) for r in records], label="mean", color="tab:orange")
    staleness_ax.plot(steps, [r.max_staleness for r in records], label="max", color="tab:red", drawstyle="steps-mid")
    staleness_ax.set_ylabel("versions")
    staleness_ax.set_xlabel("step")
    staleness_ax.set_title("staleness of trained samples")
    staleness_ax.legend(loc="best", fontsize="small")

    compute, wall = _throughput_series(records)
    throughput_ax.plot(steps, compute, label="trainer (step compute)", color="tab:purple")
    throughput_ax.plot(steps, wall, label="run (wall clock)", color="tab:brown")
    throughput_ax.set_ylabel("tokens / s")
    throughput_ax.set_xlabel("step")
    throughput_ax.set_title("trained tokens per second")
    throughput_ax.legend(loc="best", fontsize="small")

    if evals:
        _draw_evals(panels["eval"], evals)
    for ax in panels.values():
        ax.grid(True, alpha=0.3)
    figure.suptitle(title or "asyncgrpo run")
    figure.tight_layout()
    return figure


def _draw_evals(ax: Any, evals: list[EvalRecord]) -> None:
    evals = sorted(evals, key=lambda record: record.version)
    versions = [record.version for record in evals]
    ax.plot(versions, [_value(r.metrics.get("reward")) for r in evals], marker="o", label="eval reward")
    keys = sorted({key for r in evals for key in r.metrics if key.startswith("pass@")}, key=lambda k: int(k[5:]))
    for key in keys:
        ax.plot(versions, [_value(r.metrics.get(key)) for r in evals], marker=".", linestyle="--", label=key)
    ax.set_xlabel("version")
    ax.set_title(EVAL_PANEL_TITLE)
    ax.legend(loc="best", fontsize="small")


def plot_run(bucket: Bucket, run: str, out: Path) -> Path:
    """Plot every step record of ``run``, and its eval records if it has any, into ``out``."""
    records = load_step_records(bucket, run)
    if not records:
        raise PlotError(f"run {run!r} has no step records in {bucket!r} yet; wait for the first published step")
    return plot_records(records, out, title=f"asyncgrpo run {run}", evals=load_eval_records(bucket, run))
