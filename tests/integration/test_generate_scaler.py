"""`asyncgrpo scale-generate` as a process: a real proxy on loopback, a measured run, a fake systemctl.

systemd is not PID 1 on the test machines, so the unit manager is ``tests/support/fake_systemctl.py``, which
answers ``list-units``, ``start`` and ``stop`` in systemctl's format and records them. The decisions with the
default policy (scale-down delay) are tested in tests/unit/asyncgrpo/test_scaler.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from redis import Redis

from cli.local_cluster import free_port
from proxy.api.app import create_app
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.paths import REPO_ROOT
from tests.support.proxy_harness import (
    ManualClock,
    advance_version,
    file_bucket,
    paced_coordinator,
    step_at_pace,
)

pytestmark = pytest.mark.processes  # a child process per test (see tests/conftest.py)

FAKE_SYSTEMCTL = REPO_ROOT / "tests" / "support" / "fake_systemctl.py"


def fake_systemctl(tmp_path: Path, units: dict[str, str], refuse: str | None = None) -> tuple[Path, Path]:
    """(the systemctl to pass, its state file) with ``units`` (name -> ACTIVE state) installed."""
    state = tmp_path / "systemd.json"
    state.write_text(json.dumps({"units": units, "calls": [], "refuse": refuse}))
    wrapper = tmp_path / "systemctl"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SYSTEMCTL}" "{state}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, state


def scale(url: str, systemctl: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ["scale-generate", "--once", "--proxy", url, "--token", API_TOKEN, "--systemctl", str(systemctl)]
    return subprocess.run(
        [sys.executable, "-m", "cli", *args, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )


def active(state: Path) -> list[str]:
    return sorted(unit for unit, s in json.loads(state.read_text())["units"].items() if s == "active")


def test_the_host_follows_the_proxy_up_and_down_to_a_finished_run(
    redis_client: Redis, tmp_path: Path, clock: ManualClock
) -> None:
    coord = paced_coordinator(redis_client, file_bucket(tmp_path), clock)
    systemctl, state = fake_systemctl(
        tmp_path,
        {
            "asyncgrpo-generate@0.service": "active",
            "asyncgrpo-generate@1.service": "failed",  # a broken GPU: not running, so not counted
            "asyncgrpo-proxy.service": "active",
        },
    )
    with served(create_app(coord, API_TOKEN, run_loop=False)) as url:
        unmeasured = scale(url, systemctl, "--max-workers", "4")
        assert unmeasured.returncode == 0, unmeasured.stderr
        assert active(state) == ["asyncgrpo-generate@0.service", "asyncgrpo-proxy.service"], "no signal: held"

        submitted: set[str] = set()
        advance_version(coord, submitted)
        for _ in range(4):  # 4 tasks per version at 0.99 s against 1.6 s steps: 3 workers wanted
            step_at_pace(coord, clock, submitted, task_s=0.99, step_s=1.6, workers=1)
        assert coord.status().fleet is not None and coord.status().fleet.wanted == 3
        up = scale(url, systemctl, "--max-workers", "4")
        assert up.returncode == 0, up.stderr
        assert active(state) == [
            "asyncgrpo-generate@0.service",
            "asyncgrpo-generate@1.service",  # the failed instance is started again: it is the lowest free GPU
            "asyncgrpo-generate@2.service",
            "asyncgrpo-proxy.service",
        ]

        step_at_pace(coord, clock, submitted, task_s=0.99, step_s=1.6, workers=1)
        assert coord.status().finished
        down = scale(url, systemctl, "--max-workers", "4", "--min-workers", "1", "--down-after", "0")
        assert down.returncode == 0, down.stderr
        assert active(state) == ["asyncgrpo-generate@0.service", "asyncgrpo-proxy.service"]
        calls = json.loads(state.read_text())["calls"]
        assert ["stop", "--no-block", "asyncgrpo-generate@2.service"] in calls
        assert not any(call[0] == "stop" and "proxy" in call[-1] for call in calls), "only generate instances"


def test_an_unreachable_proxy_holds_the_fleet_and_a_refusing_unit_manager_fails_the_round(tmp_path: Path) -> None:
    systemctl, state = fake_systemctl(
        tmp_path, {"asyncgrpo-generate@0.service": "active"}, refuse="asyncgrpo-generate@1.service"
    )
    nobody = f"http://127.0.0.1:{free_port()}"
    held = scale(nobody, systemctl, "--max-workers", "4", "--min-workers", "1")
    assert held.returncode == 0, held.stderr
    assert "scaler.proxy_unreadable" in held.stdout + held.stderr
    assert active(state) == ["asyncgrpo-generate@0.service"]

    refused = scale(nobody, systemctl, "--max-workers", "4", "--min-workers", "2")  # must start @1: refused
    assert refused.returncode == 1
    assert "masked" in refused.stdout + refused.stderr, "the unit manager's refusal is shown"
