"""`asyncgrpo local CONFIG` as a user runs it: a real subprocess on a config of the test's own, with its own
Redis, proxy and workers; refusals that start nothing; Ctrl-C that stops every child; a resumed run."""

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
import redis

from asyncgrpo.bucket import layout as bucket_keys
from cli.local_run import torch_threads_env
from proxy.coordinator.redis_store import RunKeys
from tests.support.paths import REPO_ROOT
from worker.process.settings import WorkerSettings

REPO = REPO_ROOT
RUN = "tiny-local"

# The toy task from a prompt file next to the config (a relative dataset.path resolves against the config's
# folder, not the working directory), small groups so that a step is quick.
CONFIG_TOML = """\
seed = 0

[model]
base = "tiny"

[dataset]
path = "prompts.jsonl"
answer_column = ""

[[rewards]]
name = "repeat_digit"

[sampling]
samples_per_prompt = {samples_per_prompt}

[optimizer]
total_steps = {steps}

[async]
max_staleness = 2
groups_per_task = 2
groups_per_step = 4
queue_maxsize = 8
generate_task_timeout_s = 120

[eval]
every_versions = {eval_every}

[eval.dataset]
generator = "repeat_digit"
num_prompts = 6
"""


def write_config(
    folder: Path, *, steps: int, samples_per_prompt: int = 4, name: str = RUN, eval_every: int = 0
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    prompts = "".join(json.dumps({"prompt": f"{i % 10}="}) + "\n" for i in range(64))
    (folder / "prompts.jsonl").write_text(prompts)
    path = folder / f"{name}.toml"
    path.write_text(CONFIG_TOML.format(steps=steps, samples_per_prompt=samples_per_prompt, eval_every=eval_every))
    return path


def local_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The user's environment without a Redis, bucket or thread count of its own (unless ``extra`` sets
    them); the checkout first on the path, since the command runs from another folder."""
    unset = {"ASYNCGRPO_REDIS_URL", "ASYNCGRPO_BUCKET", "ASYNCGRPO_TORCH_THREADS", "ASYNCGRPO_RUN"}
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["ASYNCGRPO_CACHE"] = str(tmp_path / "cache")
    env.update(extra)
    return env


def local_command(config: Path, workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cli", "local", str(config), "--workdir", str(workdir), *extra]


def run_local_json(tmp_path: Path, config: Path, *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``asyncgrpo local CONFIG --json`` to the end, from a working directory that is not the config's."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir(exist_ok=True)
    return subprocess.run(
        local_command(config, tmp_path / "work", "--json"),
        cwd=cwd,
        env=local_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def spawned_children(workdir: Path) -> list[str]:
    """Every child the local run spawned has a log file in the work folder."""
    return sorted(path.name for path in (workdir / "logs").glob("*.log"))


# ---- refusals: nothing is started --------------------------------------------------------------------


def test_a_bad_config_is_one_clear_error_and_starts_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cfg", steps=3, samples_per_prompt=0)
    done = subprocess.run(
        local_command(config, tmp_path / "work"), env=local_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "sampling.samples_per_prompt" in done.stderr and "greater than or equal to 2" in done.stderr
    assert "Traceback" not in done.stderr
    assert spawned_children(tmp_path / "work") == []
    assert not (tmp_path / "work" / "bucket" / bucket_keys.run_manifest_key(RUN)).exists()


def test_a_config_name_that_is_no_run_name_asks_for_run(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cfg", steps=3, name="my config")
    done = subprocess.run(
        local_command(config, tmp_path / "work"), env=local_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "'my config' is not allowed" in done.stderr and "pass --run NAME" in done.stderr
    assert not (tmp_path / "work").exists()


def test_a_new_run_refuses_state_of_its_name_in_a_shared_redis(tmp_path: Path, redis_url: str) -> None:
    """The run is not in the bucket, but the shared Redis holds a run of that name (kept in another bucket):
    the proxy would take that state for this run's, so nothing is created or started."""
    client = redis.Redis.from_url(redis_url)
    client.hset(RunKeys(RUN).state, mapping={"current_version": 7})
    config = write_config(tmp_path / "cfg", steps=3)
    done = subprocess.run(
        local_command(config, tmp_path / "work"),
        env=local_env(tmp_path, ASYNCGRPO_REDIS_URL=redis_url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"already holds the state of a run named '{RUN}'" in done.stderr
    assert "pick another --run name" in done.stderr
    assert spawned_children(tmp_path / "work") == []
    assert not (tmp_path / "work" / "bucket" / bucket_keys.run_manifest_key(RUN)).exists()


def test_torch_threads_split_the_cores_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCGRPO_TORCH_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert torch_threads_env(3, WorkerSettings()) == {"ASYNCGRPO_TORCH_THREADS": str(max(1, cores // 3))}
    assert torch_threads_env(10_000, WorkerSettings()) == {"ASYNCGRPO_TORCH_THREADS": "1"}
    monkeypatch.setenv("ASYNCGRPO_TORCH_THREADS", "5")
    assert torch_threads_env(3, WorkerSettings()) == {}  # the workers inherit the user's value


# ---- real runs ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_local_runs_a_config_of_its_own_to_the_end(tmp_path: Path) -> None:
    done = run_local_json(tmp_path, write_config(tmp_path / "cfg", steps=3, eval_every=2), timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must hold the JSON line only: {lines}"
    summary = json.loads(lines[0])
    assert summary["steps"] == 3 and summary["versions_published"] == 4
    assert summary["samples_trained"] == 3 * 4 * 4  # 3 steps x 4 groups x G=4
    assert summary["max_staleness_trained"] <= 2
    # The summary waits for the final version's evaluation: versions 0, 2 and the final 3 are evaluated.
    assert summary["eval_version"] == 3 and summary["eval_reward"] is not None
    assert sorted(path.name for path in (tmp_path / "work").rglob("evals/v*.json")) == [
        "v00000000.json",
        "v00000002.json",
        "v00000003.json",
    ]
    # Redis, the proxy, one optimize worker and the default two generate workers, each with its log.
    expected = ["generate-2.log", "generate-3.log", "optimize-1.log", "proxy.log", "redis.log"]
    assert spawned_children(tmp_path / "work") == expected


@pytest.mark.slow
def test_sigint_stops_every_child_and_the_same_command_resumes_the_run(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT, even when the shell started it with SIGINT ignored) ends the command with 130 and every
    child with it; the same command again picks the run up from the bucket and finishes it."""
    steps = 8
    config = write_config(tmp_path / "cfg", steps=steps)
    workdir = tmp_path / "work"
    local = subprocess.Popen(
        local_command(config, workdir),
        env=local_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    metrics = workdir / "bucket" / bucket_keys.metrics_prefix(RUN)
    try:
        parent = psutil.Process(local.pid)
        deadline = time.monotonic() + 180
        children: list[psutil.Process] = []
        # Redis, the proxy, one optimize and two generate workers, and a first step taken.
        while time.monotonic() < deadline:
            children = parent.children(recursive=True)
            if len(children) >= 5 and any(metrics.glob("*.json")):
                break
            assert local.poll() is None, local.stderr.read().decode()[-3000:] if local.stderr else ""
            time.sleep(0.2)
        assert len(children) >= 5, f"the local run did not start its processes: {children}"
        local.send_signal(signal.SIGINT)
        assert local.wait(timeout=90) == 130
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
    finally:
        if local.poll() is None:
            local.kill()
    steps_before = len(list(metrics.glob("*.json")))
    assert 1 <= steps_before < steps, "interrupted too late to test a resume"

    done = run_local_json(tmp_path, config, timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming run: tiny-local" in done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == steps and summary["versions_published"] == steps + 1
    assert summary["max_staleness_trained"] <= 2
