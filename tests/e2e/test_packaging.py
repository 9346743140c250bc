"""The package as a small proxy-only VM installs it: a fresh venv, ``pip install <repo>`` (no extras, no -e).

Without torch there, ``asyncgrpo run create`` writes a run into a file:// bucket, and both entry points of the
proxy (``asyncgrpo proxy`` and ``python -m proxy``) start against a private Redis and answer ``/healthz`` and
``/v1/status``. Nothing runs from the checkout: commands run outside it, without PYTHONPATH, so only what
``pyproject.toml`` declares and ships is there (dependencies, package data). pip's cache is reused, so this
costs the install of the base dependencies once and then seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.fixtures_redis import free_port
from tests.support.paths import PACKAGES, REPO_ROOT

pytestmark = pytest.mark.slow

ROOT = REPO_ROOT
TOKEN = "packaging-test-token"
RUN = "pkg-run"
# What `pip install .` reads: the metadata, the readme it names and the packages.
SOURCES = ("pyproject.toml", "README.md", *PACKAGES)


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that would point back at the checkout or its settings."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("ASYNCGRPO_") and key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no system site packages) with the package installed from a copy of the checkout."""
    base = tmp_path_factory.mktemp("packaging")
    source = base / "src"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, source / name)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    # No --no-cache-dir: pip's wheel cache makes every run after the first fast.
    install = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "--quiet", str(source)],
        cwd=base,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, f"pip install failed:\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}"
    return bin_dir


def test_base_install_has_no_torch(installed: Path) -> None:
    probe = "import importlib.util as u; print([m for m in ('torch', 'transformers', 'peft') if u.find_spec(m)])"
    found = subprocess.run(
        [str(installed / "python"), "-c", probe], env=_clean_env(), capture_output=True, text=True, timeout=60
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "[]", f"the base install pulled in {found.stdout.strip()}"


@pytest.fixture
def created_run(installed: Path, tmp_path: Path) -> str:
    bucket = f"file://{tmp_path / 'bucket'}"
    config = str(ROOT / "examples" / "demo.toml")
    create = subprocess.run(
        [str(installed / "asyncgrpo"), "run", "create", config, "--run", RUN, "--bucket", bucket],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert create.returncode == 0, f"asyncgrpo run create failed:\n{create.stdout}\n{create.stderr}"
    return bucket


@contextmanager
def _serve(command: list[str], cwd: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    log = (cwd / "proxy.log").open("wb")
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


def _wait_healthy(process: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            pytest.fail(f"the proxy exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the proxy did not answer /healthz within 60 s:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)


@pytest.mark.parametrize("entry_point", ["asyncgrpo proxy", "python -m proxy"])
def test_proxy_serves_from_the_base_install(
    entry_point: str, installed: Path, created_run: str, redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    if entry_point == "asyncgrpo proxy":
        program = [str(installed / "asyncgrpo"), "proxy"]
    else:
        program = [str(installed / "python"), "-m", "proxy"]
    env = _clean_env(
        ASYNCGRPO_BUCKET=created_run,
        ASYNCGRPO_REDIS_URL=redis_url,
        ASYNCGRPO_TOKEN=TOKEN,
        ASYNCGRPO_RUN=RUN,
    )
    url = f"http://127.0.0.1:{port}"
    with _serve([*program, "--host", "127.0.0.1", "--port", str(port)], tmp_path, env) as process:
        _wait_healthy(process, url, tmp_path / "proxy.log")
        status = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert status.status_code == 200, status.text
        assert status.json()["run"] == RUN
