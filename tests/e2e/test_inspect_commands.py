"""Custom ``celery inspect`` commands answered by a real Celery worker over a private Redis broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

import worker.process.inspect_commands  # noqa: F401  (registers the commands, as the worker process does)
from asyncgrpo.bucket.backends import open_bucket
from asyncgrpo.bucket.layout import write_version
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.run.config import RunConfig
from tests.support.e2e_harness import stop_process_group
from tests.support.fixtures_redis import free_port
from worker.generate.adapter_cache import AdapterCache
from worker.generate.transformers_backend import TransformersBackend
from worker.process.celery_app import app, control_exchange
from worker.process.runtime import RunContext, WorkerRuntime
from worker.process.settings import WorkerSettings, process_settings

RUN = "inspect-run"


@pytest.fixture
def generate_runtime(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[WorkerRuntime]:
    """The process runtime of a generate worker holding versions 3 and 4 of a run, with a loaded backend."""
    monkeypatch.setenv("ASYNCGRPO_WORKER_ROLE", "generate")
    monkeypatch.setenv("ASYNCGRPO_WORKER_ID", "gpu-box-generate-0")
    monkeypatch.setenv("ASYNCGRPO_DEVICE", "cpu")
    settings = WorkerSettings()
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    runtime = WorkerRuntime(
        role="generate", settings=settings, bucket=bucket, client=ProxyClient("http://127.0.0.1:9", None)
    )
    config = RunConfig.model_validate({"model": {"base": str(tiny_model_dir)}})
    runtime.runs[RUN] = RunContext(run=RUN, config=config, prompts=[])
    runtime.backend = TransformersBackend(str(tiny_model_dir), device="cpu")
    runtime.backend_run = RUN
    cache = AdapterCache(bucket, RUN, tmp_path / "cache", capacity=3)
    for version in (3, 4):
        files = {"adapter_config.json": json.dumps({"v": version}).encode(), "adapter_model.safetensors": b"w"}
        _, sha = write_version(bucket, RUN, version, files, {})
        cache.get(version, sha)
    runtime.adapter_caches[RUN] = cache
    monkeypatch.setattr(app, "runtime", runtime)
    yield runtime


@pytest.fixture
def celery_worker_app(redis_url: str) -> Iterator[Celery]:
    app = Celery("asyncgrpo-inspect-test", broker=redis_url)
    app.conf.update(
        task_serializer="json", accept_content=["json"], result_backend=None, worker_hijack_root_logger=False
    )
    with start_worker(app, pool="solo", concurrency=1, perform_ping_check=False, shutdown_timeout=10):
        _wait_until_listening(app)
        yield app


def _wait_until_listening(app: Celery) -> None:
    """Broadcasts sent before the worker subscribes to its control channel are lost (Redis pub/sub): wait for a pong."""
    deadline = time.monotonic() + 30
    while not app.control.ping(timeout=1):
        assert time.monotonic() < deadline, "the in-process worker never answered a ping"


def _ask(app: Celery, command: str) -> dict:
    replies = app.control.inspect(timeout=10, limit=1)._request(command)
    assert replies, f"no worker answered `celery inspect {command}`"
    (answer,) = replies.values()
    return answer


def test_adapter_versions_and_model_info_answer_from_the_runtime(
    generate_runtime: WorkerRuntime,
    celery_worker_app: Celery,
    tiny_model_dir: Path,
) -> None:
    versions = _ask(celery_worker_app, "adapter_versions")
    assert versions["role"] == "generate"
    assert versions["worker_id"] == "gpu-box-generate-0"
    assert versions["versions_cached"] == [3, 4]
    assert versions["versions_by_run"] == {RUN: [3, 4]}
    assert versions["trainer_version"] is None

    info = _ask(celery_worker_app, "model_info")
    assert info["models_by_run"] == {RUN: str(tiny_model_dir)}
    assert info["device"] == "cpu" and info["device_setting"] == "cpu"
    assert info["backend"] == "TransformersBackend"
    assert info["loaded"] is True


def test_commands_say_what_to_fix_without_a_role(
    generate_runtime: WorkerRuntime, celery_worker_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCGRPO_WORKER_ROLE", "trainer")
    process_settings.cache_clear()  # a worker process started with this environment
    answer = _ask(celery_worker_app, "model_info")
    assert "ASYNCGRPO_WORKER_ROLE='trainer' is invalid: Input should be 'generate' or 'optimize'" in answer["error"]
    monkeypatch.delenv("ASYNCGRPO_WORKER_ROLE")
    process_settings.cache_clear()
    answer = _ask(celery_worker_app, "model_info")
    assert "ASYNCGRPO_WORKER_ROLE is not set; start workers with `asyncgrpo worker" in answer["error"]


def test_a_real_worker_process_answers_the_custom_commands(redis_url: str, tmp_path: Path) -> None:
    """`asyncgrpo worker generate` as an operator starts it: the Celery app's `include` loads the commands."""
    env = {
        **os.environ,
        "ASYNCGRPO_RUN": RUN,  # a worker serves one run's queues and answers that run's `celery inspect`
        "ASYNCGRPO_REDIS_URL": redis_url,
        "ASYNCGRPO_BUCKET": f"file://{tmp_path / 'bucket'}",
        "ASYNCGRPO_PROXY_URL": f"http://127.0.0.1:{free_port()}",  # no proxy: heartbeats fail, and are only logged
        "ASYNCGRPO_WORKER_ID": "inspect-real-0",
        "ASYNCGRPO_HEARTBEAT_S": "60",
        "ASYNCGRPO_CACHE": str(tmp_path / "cache"),
        "ASYNCGRPO_TORCH_THREADS": "1",  # torch's default here is every core (2 or more)
    }
    command = [sys.executable, "-m", "cli", "worker", "generate"]
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    client = Celery("asyncgrpo-inspect-client", broker=redis_url)
    client.conf.update(task_serializer="json", accept_content=["json"], result_backend=None)
    client.conf.update(control_exchange=control_exchange(RUN))  # as `celery inspect` with ASYNCGRPO_RUN=RUN
    try:
        deadline = time.monotonic() + 90
        replies: dict = {}
        while not replies:
            assert process.poll() is None, f"the worker exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no answer from the worker: {log_path.read_text()[-3000:]}"
            replies = client.control.inspect(timeout=2, limit=1)._request("adapter_versions") or {}
        (answer,) = replies.values()
        assert answer.get("role") == "generate", f"the worker does not know the command: {answer}"
        assert answer["worker_id"] == "inspect-real-0"
        assert answer["versions_cached"] == []
        (info,) = (client.control.inspect(timeout=10, limit=1)._request("model_info") or {"": {}}).values()
        assert info.get("torch_threads") == 1, f"ASYNCGRPO_TORCH_THREADS was not applied: {info}"
    finally:
        stop_process_group(process)
