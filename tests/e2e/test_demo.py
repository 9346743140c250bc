"""`asyncgrpo demo` as a user runs it: a real subprocess with its own Redis, proxy and workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

SUMMARY_KEYS = {
    "steps",
    "versions_published",
    "reward_first10",
    "reward_last10",
    "max_staleness_trained",
    "samples_trained",
    "samples_dropped_stale",
    "wall_s",
}


def demo_command(workdir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cli", "demo", "--steps", str(steps), "--workdir", str(workdir), *extra]


def demo_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ASYNCGRPO_REDIS_URL"}
    env["ASYNCGRPO_CACHE"] = str(tmp_path / "cache")
    return env


def run_demo_json(tmp_path: Path, steps: int, *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``asyncgrpo demo --json`` to the end, its output captured."""
    return subprocess.run(
        demo_command(tmp_path / "work", steps, "--json"),
        env=demo_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_short_demo_prints_one_json_summary(tmp_path: Path) -> None:
    done = run_demo_json(tmp_path, 3, timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must hold the JSON line only: {lines}"
    summary = json.loads(lines[0])
    assert set(summary) >= SUMMARY_KEYS
    assert summary["steps"] == 3 and summary["versions_published"] == 4
    assert summary["samples_trained"] == 3 * 8 * 8  # 3 steps x 8 groups x G=8
    assert summary["max_staleness_trained"] <= 2
    assert summary["eval_version"] == 3  # the demo evaluates its final version (and 0) before it stops


def test_the_asynchronous_system_learns(tmp_path: Path) -> None:
    """Several processes (Redis, proxy, optimize and generate workers) sharing only Redis and a bucket learn
    the toy task: the reward of the last ten steps is well above that of the first ten (about 0.1 -> 0.5 in
    150 steps here), with every sample within the staleness bound."""
    done = run_demo_json(tmp_path, 150, timeout_s=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["versions_published"] == 151
    assert summary["max_staleness_trained"] <= 2
    assert summary["flagged_rollouts"] == 0
    assert summary["reward_last10"] >= summary["reward_first10"] + 0.2, summary
    assert summary["eval_version"] == 150 and summary["eval_reward"] is not None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_every_child(tmp_path: Path, sig: signal.Signals) -> None:
    demo = subprocess.Popen(
        demo_command(tmp_path / "work", 100_000),
        env=demo_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        # As a shell starts a background job: SIGINT ignored on entry; the demo must still honour it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        parent = psutil.Process(demo.pid)
        deadline = time.monotonic() + 120
        children: list[psutil.Process] = []
        # Redis, the proxy, one optimize and two generate workers, and a first version published.
        while time.monotonic() < deadline:
            children = parent.children(recursive=True)
            if len(children) >= 5 and any((tmp_path / "work" / "bucket").rglob("MANIFEST.json")):
                break
            assert demo.poll() is None, demo.stderr.read().decode()[-3000:] if demo.stderr else ""
            time.sleep(0.5)
        assert len(children) >= 5, f"the demo did not start its processes: {children}"
        demo.send_signal(sig)
        assert demo.wait(timeout=90) == 130
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
    finally:
        if demo.poll() is None:
            demo.kill()
