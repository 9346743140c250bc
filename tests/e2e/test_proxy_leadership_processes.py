"""One live proxy per run, with real ``python -m proxy`` processes on a private Redis and a file:// bucket.

A second proxy for a run is refused with a message naming the holder; a stand-by waits and takes over when
the live proxy dies and its leadership lapses (the shipped TTL, no shortened timeouts); a proxy whose
leadership is taken over stops coordinating and exits non-zero.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from redis import Redis

from asyncgrpo.run.creation import create_run
from proxy.coordinator.redis_store import RunKeys
from proxy.coordinator.snapshot import DEFAULT_LEADERSHIP_TTL_S, Leader
from tests.support.fixtures_redis import free_port
from tests.support.fixtures_s3 import open_env_bucket
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.slow

ROOT = REPO_ROOT
RUN = "fence1"
TOKEN = "t" * 32


@pytest.fixture
def bucket_url(tmp_path: Path) -> str:
    url = f"file://{tmp_path / 'bucket'}"
    create_run(ROOT / "examples" / "demo.toml", RUN, open_env_bucket(url))
    return url


def _env(bucket_url: str, redis_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCGRPO_")}
    env.update(
        ASYNCGRPO_BUCKET=bucket_url,
        ASYNCGRPO_REDIS_URL=redis_url,
        ASYNCGRPO_TOKEN=TOKEN,
        ASYNCGRPO_RUN=RUN,
        PYTHONPATH=str(ROOT),
    )
    return env


def _start(tmp_path: Path, name: str, env: dict[str, str], *extra: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / f"{name}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port), *extra],
        cwd=tmp_path,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    return process, f"http://127.0.0.1:{port}", log


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if process.poll() is not None:
            pytest.fail(f"the proxy exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"the proxy did not answer /healthz within {timeout_s} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def _stop(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_second_proxy_for_the_run_is_refused_naming_the_holder(bucket_url: str, redis_url: str, tmp_path: Path) -> None:
    env = _env(bucket_url, redis_url)
    first, url, log = _start(tmp_path, "first", env)
    try:
        _wait_healthy(first, url, log)
        second, _, second_log = _start(tmp_path, "second", env)
        assert second.wait(timeout=60) != 0
        text = second_log.read_text()
        assert f"run {RUN!r} is already coordinated by another proxy" in text
        assert f"pid {first.pid}" in text and "--standby" in text
        assert first.poll() is None and _healthy(url), "the live proxy goes on"
    finally:
        _stop(first)


def test_standby_takes_over_when_the_live_proxy_dies(bucket_url: str, redis_url: str, tmp_path: Path) -> None:
    env = _env(bucket_url, redis_url)
    redis = Redis.from_url(redis_url, decode_responses=True)
    first, url, log = _start(tmp_path, "first", env)
    standby = None
    try:
        _wait_healthy(first, url, log)
        first_epoch = Leader.parse(redis.get(RunKeys(RUN).proxy_leadership)).epoch
        standby, standby_url, standby_log = _start(tmp_path, "standby", env, "--standby")
        time.sleep(DEFAULT_LEADERSHIP_TTL_S)  # a whole TTL: the live proxy renews, the stand-by only waits
        assert standby.poll() is None and not _healthy(standby_url)
        assert "proxy.standby_waiting" in standby_log.read_text()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        killed = time.monotonic()
        _wait_healthy(standby, standby_url, standby_log, timeout_s=30)
        assert time.monotonic() - killed < DEFAULT_LEADERSHIP_TTL_S + 5, "taken over within about one leadership TTL"
        holder = Leader.parse(redis.get(RunKeys(RUN).proxy_leadership))
        assert holder.pid == standby.pid and holder.epoch > first_epoch
    finally:
        _stop(first, *([standby] if standby else []))


def test_proxy_whose_leadership_is_taken_stops_and_exits_non_zero(
    bucket_url: str, redis_url: str, tmp_path: Path
) -> None:
    env = _env(bucket_url, redis_url)
    redis = Redis.from_url(redis_url, decode_responses=True)
    first, url, log = _start(tmp_path, "first", env)
    try:
        _wait_healthy(first, url, log)
        # Another proxy holds the leadership now (as if this one had been paused past its TTL).
        key = RunKeys(RUN).proxy_leadership
        thief = '{"holder":"other","epoch":999,"host":"elsewhere","pid":1,"since_ms":0}'
        redis.set(key, thief, px=60_000)
        assert first.wait(timeout=30) != 0
        assert "proxy.leadership_lost" in log.read_text() and "elsewhere" in log.read_text()
    finally:
        _stop(first)
