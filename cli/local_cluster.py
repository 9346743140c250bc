"""Run a whole asyncgrpo system on one machine as real processes: Redis, the proxy, Celery workers.

Used by ``asyncgrpo demo`` and by the end-to-end tests. Every child gets its own process group and a log
file; ``stop()`` (also on Ctrl-C, and at interpreter exit) ends them all, so no process is left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
import structlog

log = structlog.get_logger()


class ClusterError(RuntimeError):
    """A local service that could not be started; the message says what to install or change."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


@dataclass
class ChildProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def kill_hard(self) -> None:
        """kill -9 of the whole process group, as a preemption without notice would."""
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    def stop(self, timeout_s: float = 15.0) -> None:
        if not self.alive():
            return
        self.signal_group(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_hard()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalCluster:
    workdir: Path
    run: str = "demo"
    redis_url: str | None = None
    bucket_url: str | None = None  # default: a file:// bucket inside workdir
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    extra_env: dict[str, str] = field(default_factory=dict)
    children: list[ChildProcess] = field(default_factory=list)
    proxy_url: str = ""
    _worker_count: int = 0
    _expected_dead: set[int] = field(default_factory=set)  # pids

    def __post_init__(self) -> None:
        self.workdir = self.workdir.resolve()
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.bucket_url = self.bucket_url or f"file://{self.workdir / 'bucket'}"
        atexit.register(self.stop)

    # -- services ------------------------------------------------------------------------------------
    def ensure_redis(self) -> str:
        """Use ``redis_url`` when it answers, else start a private redis-server on a free port."""
        if self.redis_url and redis_reachable(self.redis_url):
            return self.redis_url
        binary = shutil.which("redis-server")
        if binary is None:
            raise ClusterError(
                "no Redis reachable and no redis-server installed: set ASYNCGRPO_REDIS_URL to a running Redis, or "
                "install one (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis)"
            )
        port = free_port()
        self._spawn(
            "redis",
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            env=dict(os.environ),
        )
        url = f"redis://127.0.0.1:{port}/0"
        self._wait_until(lambda: redis_reachable(url), 10.0, "redis-server")
        self.redis_url = url
        return url

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "ASYNCGRPO_REDIS_URL": self.redis_url or "",
                "ASYNCGRPO_BUCKET": self.bucket_url,
                "ASYNCGRPO_TOKEN": self.token,
                "ASYNCGRPO_PROXY_URL": self.proxy_url,
                "ASYNCGRPO_RUN": self.run,  # the proxy coordinates this run; the workers consume its queues
                "ASYNCGRPO_CACHE": str(self.workdir / "cache"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    def start_proxy(self, port: int | None = None) -> ChildProcess:
        port = port or (int(self.proxy_url.rsplit(":", 1)[1]) if self.proxy_url else free_port())
        self.proxy_url = f"http://127.0.0.1:{port}"
        child = self._spawn(
            "proxy",
            [
                sys.executable,
                "-m",
                "cli",
                "proxy",
                "--run",
                self.run,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--standby",
            ],  # a restarted proxy waits for the leadership of the one it replaces
            env=self.env(),
        )
        self._wait_until(self._proxy_healthy, 30.0, "proxy", child)
        return child

    def start_worker(
        self, role: str, name: str | None = None, env: dict[str, str] | None = None, nproc_per_node: int = 1
    ) -> ChildProcess:
        """A worker process; ``nproc_per_node`` > 1 starts an optimize worker of that many ranks (the child is
        their launcher)."""
        self._worker_count += 1
        name = name or f"{role}-{self._worker_count}"
        child_env = self.env()
        child_env["ASYNCGRPO_WORKER_ID"] = name
        child_env.update(env or {})
        argv = [sys.executable, "-m", "cli", "worker", role]
        if nproc_per_node > 1:
            argv += ["--nproc-per-node", str(nproc_per_node)]
        return self._spawn(name, argv, env=child_env)

    # -- observation ---------------------------------------------------------------------------------
    def _proxy_healthy(self) -> bool:
        try:
            return httpx.get(f"{self.proxy_url}/healthz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def status(self) -> dict:
        response = httpx.get(
            f"{self.proxy_url}/v1/status", headers={"Authorization": f"Bearer {self.token}"}, timeout=5.0
        )
        response.raise_for_status()
        return response.json()

    def check_children(self) -> None:
        for child in self.children:
            if not child.alive() and child.pid not in self._expected_dead:
                raise ClusterError(
                    f"{child.name} exited with code {child.popen.returncode}; last log lines:\n{child.log_tail()}"
                )

    def expect_dead(self, child: ChildProcess) -> None:
        self._expected_dead.add(child.pid)

    # -- plumbing ------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> ChildProcess:
        log_path = self.workdir / "logs" / f"{name}.log"
        handle = log_path.open("ab")
        popen = subprocess.Popen(
            argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        handle.close()
        child = ChildProcess(name=name, popen=popen, log_path=log_path)
        self.children.append(child)
        return child

    def _wait_until(self, ready, timeout_s: float, what: str, child: ChildProcess | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            if child is not None and not child.alive():
                raise ClusterError(f"{what} exited during start-up; last log lines:\n{child.log_tail()}")
            time.sleep(0.1)
        tail = child.log_tail() if child is not None else ""
        raise ClusterError(f"{what} did not become ready within {timeout_s:.0f} s\n{tail}")

    def stop(self) -> None:
        """Stop every child: workers first (they hand their tasks back), then the proxy, then Redis."""
        order = {"redis": 2, "proxy": 1}
        for child in sorted(self.children, key=lambda c: order.get(c.name, 0)):
            child.stop()
        self.children.clear()
