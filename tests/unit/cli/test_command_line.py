"""The command line (``cli``): its options' defaults come from the settings, and each process it starts by module
runs the same command as the ``asyncgrpo`` binary, without the processes below naming the CLI."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import proxy.__main__
import worker.__main__
from cli.main import main as cli_main
from tests.support.paths import REPO_ROOT
from worker.process import launcher
from worker.process.settings import WorkerSettings


def test_the_command_line_takes_its_defaults_from_the_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    out = str(tmp_path / "plot.png")
    missing = runner.invoke(cli_main, ["plot", "--out", out])
    assert missing.exit_code == 2 and "missing --run: pass it or set ASYNCGRPO_RUN" in missing.output

    monkeypatch.setenv("ASYNCGRPO_RUN", "from-env")
    monkeypatch.setenv("ASYNCGRPO_BUCKET", "nope")
    bad = runner.invoke(cli_main, ["plot", "--out", out])
    assert bad.exit_code == 2 and "ASYNCGRPO_BUCKET='nope' is invalid" in bad.output

    # Both values come from the environment: the plot finds the (empty) run in that bucket.
    monkeypatch.setenv("ASYNCGRPO_BUCKET", f"file://{tmp_path / 'bucket'}")
    empty = runner.invoke(cli_main, ["plot", "--out", out])
    assert empty.exit_code == 1 and "run 'from-env' has no step records" in empty.output
    # An option given on the command line wins over the variable.
    flag = runner.invoke(cli_main, ["plot", "--run", "from-flag", "--out", out])
    assert "run 'from-flag' has no step records" in flag.output


def test_a_local_run_uses_only_the_services_the_user_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's own default bucket (``file://work/bucket``) is not a bucket the user named: the local run
    keeps its bucket in its work folder unless ASYNCGRPO_BUCKET is set."""
    from cli.local_run import configured_services

    assert configured_services(WorkerSettings()) == (None, None)
    monkeypatch.setenv("ASYNCGRPO_BUCKET", "file:///data/bucket")
    monkeypatch.setenv("ASYNCGRPO_REDIS_URL", "redis://10.0.0.5:6379/0")
    assert configured_services(WorkerSettings()) == ("redis://10.0.0.5:6379/0", "file:///data/bucket")


def test_the_proxy_and_worker_commands_are_those_their_packages_define() -> None:
    """One definition of each: ``asyncgrpo proxy`` is ``python -m proxy``, ``asyncgrpo worker`` is ``python -m
    worker``, so their options cannot drift apart."""
    assert cli_main.commands["proxy"] is proxy.__main__.main
    assert cli_main.commands["worker"] is worker.__main__.main


def test_python_m_worker_checks_the_role_and_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    unknown = runner.invoke(worker.__main__.main, ["train"])
    assert unknown.exit_code == 2 and "'train' is not one of 'generate', 'optimize'" in unknown.output
    missing = runner.invoke(worker.__main__.main, ["generate"])
    assert missing.exit_code == 1 and "Error: ASYNCGRPO_RUN is not set" in missing.output, missing.output
    monkeypatch.setenv("ASYNCGRPO_RUN", "r1")
    ranks = runner.invoke(worker.__main__.main, ["generate", "--nproc-per-node", "2"])
    assert ranks.exit_code == 1 and "--nproc-per-node 2 is for optimize workers" in ranks.output, ranks.output


def test_an_optimize_workers_ranks_run_the_worker_command_by_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank is started by ``torch.distributed.run -m worker optimize ...``: the worker's own entry, with
    the extra arguments for Celery; ``--nproc-per-node`` is not passed on (a rank is one process)."""
    calls: list[list[str]] = []
    monkeypatch.setattr(launcher.os, "execvpe", lambda file, argv, env: calls.append(argv))
    monkeypatch.setenv("ASYNCGRPO_RUN", "r1")
    CliRunner().invoke(cli_main, ["worker", "optimize", "--nproc-per-node", "2", "--without-gossip"])
    argv = calls[0]  # the real execvpe does not return: what follows it in run_worker never runs
    assert argv[1:3] == ["-m", "torch.distributed.run"] and argv[argv.index("--nproc-per-node") + 1] == "2"
    module_at = len(argv) - 1 - argv[::-1].index("-m")
    assert argv[module_at + 1 :] == ["worker", "optimize", "--without-gossip"]
    assert "cli" not in argv


@pytest.mark.parametrize(("module", "usage"), [("cli", "Usage: asyncgrpo "), ("worker", "Usage: python -m worker ")])
def test_the_packages_run_as_modules(
    module: str, usage: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m cli`` (what local clusters and tests start) and ``python -m worker`` answer as commands."""
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    monkeypatch.delitem(sys.modules, f"{module}.__main__", raising=False)  # run afresh, as the interpreter would
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert stopped.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


def test_no_process_below_the_command_line_names_it() -> None:
    """The processes start each other by their own modules (``python -m worker``), never through ``cli``."""
    offenders = [
        str(path.relative_to(REPO_ROOT))
        for top in ("asyncgrpo", "proxy", "worker")
        for path in (REPO_ROOT / top).rglob("*.py")
        if '"cli"' in path.read_text() or "cli.main" in path.read_text()
    ]
    assert not offenders, offenders
