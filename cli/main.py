"""The ``asyncgrpo`` command line.

Every subcommand imports its role module lazily, so that ``asyncgrpo proxy`` and ``asyncgrpo run create``
work in an install without torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from asyncgrpo.protocol.settings import CacheSettings, CommonSettings, SettingsError, StorageSettings, env_name
from proxy.__main__ import main as proxy_main
from worker.__main__ import main as worker_main
from worker.process.settings import WorkerSettings

if TYPE_CHECKING:
    from asyncgrpo.bucket.backends import Bucket


def from_settings(
    field: str, settings_class: type[CommonSettings] = CommonSettings, *, required_as: str | None = None
) -> Callable[[], str | None]:
    """An option's default read from the settings (``ASYNCGRPO_<FIELD>``), so the command line sees what the
    processes see, validated the same way; a bad value is a usage error that names the variable. With
    ``required_as`` (the option's flag), neither the option nor the variable given is a usage error too (click
    takes a callable default's None as a value, so ``required=True`` alone would not catch it)."""

    def default() -> str | None:
        try:
            settings = settings_class()
        except SettingsError as error:
            raise click.UsageError(str(error)) from None
        value = settings.token_value() if field == "token" else getattr(settings, field)
        if value is None and required_as:
            raise click.UsageError(f"missing {required_as}: pass it or set {env_name(field)}")
        return value

    return default


def _open_bucket(url: str) -> Bucket:
    """The bucket at ``url``, with this command's S3 endpoint (``ASYNCGRPO_S3_ENDPOINT_URL``)."""
    from asyncgrpo.bucket.backends import open_bucket

    try:
        endpoint = StorageSettings().s3_endpoint_url
    except SettingsError as error:
        raise click.UsageError(str(error)) from None
    return open_bucket(url, s3_endpoint_url=endpoint)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Asynchronous GRPO with LoRA over Celery, Redis and a bucket."""


BUCKET_HELP = "file://PATH or s3://BUCKET/PREFIX [default: ASYNCGRPO_BUCKET]."
proxy_option = click.option(
    "--proxy",
    "proxy_url",
    default=from_settings("proxy_url", WorkerSettings),
    help="Base URL of the run's proxy [default: ASYNCGRPO_PROXY_URL, else http://127.0.0.1:8700].",
)
token_option = click.option("--token", default=from_settings("token"), help="Bearer token [default: ASYNCGRPO_TOKEN].")


@main.group()
def run() -> None:
    """Create and inspect runs."""


@run.command("create")
@click.argument("config_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--run", "run_name", required=True, help="Run name: the bucket prefix runs/<name>/.")
@click.option("--bucket", default=from_settings("bucket", required_as="--bucket"), help=BUCKET_HELP)
def run_create(config_path: Path, run_name: str, bucket: str) -> None:
    """Validate CONFIG_PATH (TOML) and write the config and the prompts into the bucket."""
    from asyncgrpo.bucket.backends import BucketError
    from asyncgrpo.bucket.layout import IntegrityError
    from asyncgrpo.run.config import ConfigError
    from asyncgrpo.run.creation import RunExistsError, create_run
    from worker.generate.agent import check_agent_of
    from worker.model.reward_models import check_reward_models_of

    try:
        check_reward_models_of(config_path)
        check_agent_of(config_path)
        summary = create_run(config_path, run_name, _open_bucket(bucket))
    except (ConfigError, RunExistsError, BucketError, IntegrityError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    click.echo(summary)


# One definition of the proxy's options: ``python -m proxy`` and ``asyncgrpo proxy`` are the same command. It
# imports only click and the proxy's settings, so the CLI still loads without torch.
main.add_command(proxy_main, "proxy")


@main.group()
def model() -> None:
    """Build models."""


@model.command("tiny")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", default=0, show_default=True, type=int)
def model_tiny(out_dir: Path, seed: int) -> None:
    """Build a small random-init causal LM and a locally trained tokenizer in OUT (no download)."""
    from worker.model.tiny_model import build_tiny_model

    build_tiny_model(out_dir, seed=seed)
    click.echo(f"tiny model written to {out_dir}")


# One definition of the worker's command too: ``python -m worker ROLE`` (what an optimize worker's ranks run) and
# ``asyncgrpo worker ROLE`` are the same command.
main.add_command(worker_main, "worker")


@main.command()
@click.option("--steps", default=None, type=int, help="Optimizer steps to run (default: the demo config's).")
@click.option("--json", "as_json", is_flag=True, help="Print one final JSON line with the run's figures.")
@click.option("--workdir", default=None, type=click.Path(file_okay=False, path_type=Path))
@click.option("--generate-workers", default=2, show_default=True, type=click.IntRange(min=1))
def demo(steps: int | None, as_json: bool, workdir: Path | None, generate_workers: int) -> None:
    """Run the whole system locally on a tiny model: Redis, proxy, workers, a file:// bucket (`asyncgrpo local`
    on an embedded config)."""
    from cli.demo import run_demo

    try:
        settings = WorkerSettings()  # this command's environment, parsed once
        sys.exit(
            run_demo(
                steps=steps, as_json=as_json, workdir=workdir, generate_workers=generate_workers, settings=settings
            )
        )
    except SettingsError as error:
        raise click.UsageError(str(error)) from None


@main.command()
@click.argument("config_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--run",
    "run_name",
    default=None,
    help="Run name [default: the config file's name without .toml]. A run of that name already in the bucket "
    "with the same config is resumed, so Ctrl-C and the same command again continue it.",
)
@click.option(
    "--workdir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Logs, caches and (without ASYNCGRPO_BUCKET) the file:// bucket [default: work/local/RUN].",
)
@click.option("--generate-workers", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print one final JSON line with the run's figures.")
def local(config_path: Path, run_name: str | None, workdir: Path | None, generate_workers: int, as_json: bool) -> None:
    """Run CONFIG_PATH (a TOML run config) on this machine: Redis, the proxy, one optimize worker and N
    generate workers as separate processes, live progress, then a summary; Ctrl-C stops them all.

    Redis: ASYNCGRPO_REDIS_URL when it answers, else a private redis-server. Bucket: ASYNCGRPO_BUCKET when
    set, else file://WORKDIR/bucket. Each worker gets an even share of the cores as torch threads unless
    ASYNCGRPO_TORCH_THREADS is set. Exit codes: 2 for a config or run name to fix, 1 for a process that failed,
    130 when interrupted.
    """
    from asyncgrpo.bucket.layout import InvalidKeyPart, check_run_name
    from cli.local_run import configured_services, run_local

    try:
        run_name = check_run_name(run_name or config_path.stem)
    except InvalidKeyPart as error:
        raise click.UsageError(f"{error}; pass --run NAME" if run_name is None else str(error)) from None
    try:
        settings = WorkerSettings()  # this command's environment, parsed once
        redis_url, bucket_url = configured_services(settings)
    except SettingsError as error:
        raise click.UsageError(str(error)) from None
    sys.exit(
        run_local(
            config_path,
            run_name=run_name,
            workdir=workdir or Path("work") / "local" / run_name,
            generate_workers=generate_workers,
            as_json=as_json,
            redis_url=redis_url,
            bucket_url=bucket_url,
            title=f"asyncgrpo local: {run_name}",
            settings=settings,
        )
    )


@main.command()
@proxy_option
@token_option
@click.option(
    "--bucket",
    default=from_settings("bucket"),
    help="The run's bucket, for its config and step records [default: ASYNCGRPO_BUCKET].",
)
@click.option("--watch", is_flag=True, help="Refresh in place until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.2), help="Seconds.")
def status(proxy_url: str, token: str | None, bucket: str | None, watch: bool, interval: float) -> None:
    """Show the run: version, step, reward trend, staleness, buffer, workers and their heartbeats."""
    from asyncgrpo.protocol.client import ProxyClient, ProxyError
    from cli.status import show_status

    with ProxyClient(proxy_url, token, retries=1) as client:
        try:
            show_status(client, _open_bucket(bucket) if bucket else None, watch=watch, interval_s=interval)
        except ProxyError as error:
            raise click.ClickException(f"cannot read the proxy at {proxy_url}: {error}") from error


@main.command("scale-generate")
@proxy_option
@token_option
@click.option("--max-workers", required=True, type=click.IntRange(min=1), help="The host's GPUs: instances 0..N-1.")
@click.option("--min-workers", default=1, show_default=True, type=click.IntRange(min=0), help="Never fewer.")
@click.option("--hosts", default=1, show_default=True, type=click.IntRange(min=1), help="Hosts sharing the fleet.")
@click.option(
    "--down-after", default=300.0, show_default=True, type=click.FloatRange(min=0), help="Seconds before scaling down."
)
@click.option("--interval", default=30.0, show_default=True, type=click.FloatRange(min=1), help="Seconds per round.")
@click.option("--unit", "template", default="asyncgrpo-generate@", show_default=True, help="The template unit.")
@click.option("--systemctl", default="systemctl", show_default=True, help="The systemctl to call.")
@click.option("--once", is_flag=True, help="One round, then exit.")
def scale_generate(
    proxy_url: str,
    token: str | None,
    max_workers: int,
    min_workers: int,
    hosts: int,
    down_after: float,
    interval: float,
    template: str,
    systemctl: str,
    once: bool,
) -> None:
    """Start and stop this host's asyncgrpo-generate@N instances to follow the proxy's generate workers wanted."""
    import structlog

    from asyncgrpo.protocol.client import ProxyClient, ProxyError
    from asyncgrpo.protocol.log_setup import configure_logging
    from cli.scaler import ScalePolicy, Scaler, SystemdUnits, run_scaler

    configure_logging(role="scaler")
    try:
        policy = ScalePolicy(max_workers, min_workers, hosts, down_after)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    log = structlog.get_logger()
    with ProxyClient(proxy_url, token, retries=1) as client:

        def read_wanted() -> int | None:
            try:
                fleet = client.status().fleet
            except ProxyError as error:
                log.warning("scaler.proxy_unreadable", proxy=proxy_url, error=str(error))
                return None
            return None if fleet is None else fleet.wanted

        failed = run_scaler(
            Scaler(policy),
            SystemdUnits(template, systemctl),
            read_wanted,
            interval_s=interval,
            rounds=1 if once else None,
        )
    if failed:
        raise click.ClickException("the round failed: the unit manager refused a command (logged above)")


@main.command()
@click.option(
    "--run", "run_name", default=from_settings("run", required_as="--run"), help="Run to plot [default: ASYNCGRPO_RUN]."
)
@click.option("--bucket", default=from_settings("bucket", required_as="--bucket"), help=BUCKET_HELP)
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path), help="PNG file.")
def plot(run_name: str, bucket: str, out_path: Path) -> None:
    """Plot reward, ratio, staleness and throughput against step, from the run's step records."""
    from cli.plot import PlotError, plot_run

    try:
        written = plot_run(_open_bucket(bucket), run_name, out_path)
    except PlotError as error:
        raise click.ClickException(str(error)) from error
    click.echo(f"plot written to {written}")


@main.command()
@click.option(
    "--run",
    "run_name",
    default=from_settings("run", required_as="--run"),
    help="Run to export from [default: ASYNCGRPO_RUN].",
)
@click.option("--bucket", default=from_settings("bucket", required_as="--bucket"), help=BUCKET_HELP)
@click.option("--version", "version", required=True, help="Version number, or 'latest'.")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="New or empty folder for the adapter (and merged/ with --merge).",
)
@click.option("--merge", is_flag=True, help="Also write the base model with the adapter merged, to OUT/merged.")
@click.option("--device", default="cpu", show_default=True, help="Device for merging: cpu, cuda, auto.")
def export(run_name: str, bucket: str, version: str, out_dir: Path, merge: bool, device: str) -> None:
    """Export a published version as a PEFT adapter folder (transformers, vLLM), optionally merged."""
    import json

    from asyncgrpo.bucket.backends import ObjectNotFound
    from asyncgrpo.bucket.layout import IntegrityError
    from cli.export import ExportError, export_version

    try:
        cache = CacheSettings().cache
        result = export_version(
            _open_bucket(bucket), run_name, version, out_dir, merge=merge, device=device, cache_dir=cache
        )
    except (ExportError, IntegrityError, ObjectNotFound) as error:
        raise click.ClickException(str(error)) from error
    click.echo(json.dumps(result.summary(), indent=2))
