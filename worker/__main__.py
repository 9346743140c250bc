"""``python -m worker ROLE``: start a generate or optimize worker, the same as ``asyncgrpo worker ROLE``.

The one definition of the ``worker`` command (the CLI adds it as ``asyncgrpo worker``, as it does ``python -m
proxy``), and what an optimize worker's ranks run: they start by module, so the worker does not name the CLI
above it. Imports only click and the settings' error until the command runs, as ``proxy.__main__`` does, so the
CLI loads without torch.
"""

from __future__ import annotations

import sys

import click

from asyncgrpo.protocol.settings import SettingsError


@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "ignore_unknown_options": True, "allow_extra_args": True}
)
@click.argument("role", type=click.Choice(["generate", "optimize"]))
@click.option(
    "--nproc-per-node",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="optimize only: train on this many local GPUs (ranks, FSDP2) as one worker.",
)
@click.pass_context
def main(ctx: click.Context, role: str, nproc_per_node: int) -> None:
    """Start a Celery worker for ROLE on the queues of ASYNCGRPO_RUN, with the right pool and flags (extra args
    go to celery)."""
    from worker.process.launcher import run_worker

    try:
        sys.exit(run_worker(role, list(ctx.args), nproc_per_node))
    except SettingsError as error:  # a missing run or a bad variable: say which, not a traceback
        raise click.ClickException(str(error)) from None


if __name__ == "__main__":
    main(prog_name="python -m worker")
