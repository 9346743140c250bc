"""``python -m proxy``: run the coordinator of one run, the same as ``asyncgrpo proxy``.

Options default to the settings (``ASYNCGRPO_RUN``, ``ASYNCGRPO_PROXY_HOST``, ``ASYNCGRPO_PROXY_PORT``); Redis,
the bucket, the token and the tick come from ``proxy.api.settings.ProxySettings``. Nothing from ``worker`` is
imported, so this runs in an install without the ``train`` extra (no torch).
"""

from __future__ import annotations

import click

from asyncgrpo.protocol.settings import SettingsError
from proxy.api.settings import ProxySettings


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run", "run_name", default=None, help="Run to coordinate [default: ASYNCGRPO_RUN].")
@click.option("--host", default=None, help="Address to listen on [default: ASYNCGRPO_PROXY_HOST or 127.0.0.1].")
@click.option(
    "--port", default=None, type=click.IntRange(1, 65535), help="Port [default: ASYNCGRPO_PROXY_PORT or 8700]."
)
@click.option(
    "--insecure-loopback",
    is_flag=True,
    help="Allow running without ASYNCGRPO_TOKEN; only accepted with a loopback --host.",
)
@click.option(
    "--standby",
    is_flag=True,
    help="If another proxy holds the run, wait and take over once it lapses [default: ASYNCGRPO_PROXY_STANDBY].",
)
def main(run_name: str | None, host: str | None, port: int | None, insecure_loopback: bool, standby: bool) -> None:
    """Run the coordinator of RUN (HTTP API, dispatch, GC)."""
    try:
        settings = ProxySettings()
    except SettingsError as error:
        raise click.ClickException(str(error)) from None
    run_name = run_name or settings.run
    if not run_name:
        raise click.UsageError("no run given: pass --run NAME or set ASYNCGRPO_RUN")
    # Imported here so that --help and a settings error answer without loading FastAPI and Celery.
    from proxy.api.app import serve

    serve(
        run_name=run_name,
        host=host or settings.proxy_host,
        port=port or settings.proxy_port,
        insecure_loopback=insecure_loopback,
        settings=settings,
        standby=standby,
    )


if __name__ == "__main__":
    main(prog_name="python -m proxy")
