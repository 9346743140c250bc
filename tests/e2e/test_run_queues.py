"""Queues per run: two runs share one Redis broker, and each run's worker takes only its own run's tasks.

The proxy side is the real ``CeleryDispatcher``; the worker is a real ``asyncgrpo worker optimize`` process
(solo Celery worker) over a private Redis. Repair tasks are what it runs: they need no proxy and no model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from redis import Redis

from asyncgrpo.bucket.layout import check_run_name
from asyncgrpo.protocol.schemas import (
    REPAIR_TASK_NAME,
    GenerateTaskMessage,
    GroupRef,
    OptimizeTaskMessage,
    RepairTaskMessage,
    check_queue_run,
    generate_queue,
    optimize_queue,
    run_queue_prefix,
    worker_queue,
)
from asyncgrpo.protocol.settings import SettingsError
from proxy.coordinator.dispatch import CeleryDispatcher
from tests.support.e2e_harness import stop_process_group
from tests.support.fixtures_redis import free_port
from worker.process import celery_app
from worker.process.settings import process_settings

RUN_A = "run-a"
RUN_B = "run-b"
WORKER_ID = "opt-1"  # the same worker id in both runs: their own queues must still differ
SHA = "0" * 64


def test_queue_names_are_per_run_and_unambiguous() -> None:
    assert generate_queue("r.1") == "asyncgrpo:r.1:generate"
    assert worker_queues_of("r.1") == ["asyncgrpo:r.1:optimize", "asyncgrpo:r.1:optimize:opt-1"]
    # With '.' between the parts, run "a.optimize"'s generate queue would be worker "generate"'s of run "a".
    assert generate_queue("a.optimize") != worker_queue("a", "generate")
    assert not generate_queue("a").startswith(run_queue_prefix("a.b"))
    assert not worker_queue("a.b", "x").startswith(run_queue_prefix("a"))
    # Every run name the bucket accepts names queues; what it refuses, the queues refuse too.
    for name in ("r", "A-b_c.9", "x" * 64):
        assert check_run_name(name) == check_queue_run(name)
    for name in ("a:b", "a,b", "", "-a", "a b", "a\n", "x" * 65):
        with pytest.raises(ValueError):
            check_run_name(name)
        with pytest.raises(ValueError, match="cannot name a queue"):
            check_queue_run(name)
    with pytest.raises(ValueError, match="worker id 'a,b' cannot name a queue"):
        worker_queue("r", "a,b")


def worker_queues_of(run: str) -> list[str]:
    return [optimize_queue(run), worker_queue(run, WORKER_ID)]


def test_a_worker_process_without_a_run_does_not_build_its_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the Celery process of `asyncgrpo worker` (role set) does if it gets no run: no app, a clear error."""
    monkeypatch.delenv("ASYNCGRPO_RUN", raising=False)
    monkeypatch.setenv("ASYNCGRPO_WORKER_ROLE", "optimize")
    with pytest.raises(SettingsError, match="ASYNCGRPO_RUN is not set"):
        celery_app.build_celery_app()
    monkeypatch.setenv("ASYNCGRPO_RUN", RUN_B)
    process_settings.cache_clear()  # the next worker process, started with a run
    app = celery_app.build_celery_app()
    assert app.conf.control_exchange == "asyncgrpo:run-b:control"
    assert app.conf.task_routes["asyncgrpo.optimize"] == {"queue": optimize_queue(RUN_B)}


def _log_events(path: Path) -> list[dict[str, Any]]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _inspect_client(redis_url: str, run: str) -> Celery:
    client = Celery(f"asyncgrpo-client-{run}", broker=redis_url, set_as_current=False)
    client.conf.update(celery_app.run_routing(run), accept_content=["json"], result_backend=None)
    return client


def test_two_runs_on_one_redis_take_only_their_own_tasks(redis_url: str, tmp_path: Path) -> None:
    broker = Redis.from_url(redis_url, decode_responses=True)
    dispatcher = CeleryDispatcher(redis_url)
    # Run A's proxy dispatches one of each kind: a generate task, a step for any trainer, a repair for opt-1.
    group = GroupRef(group_id="g.0", prompt_index=0)
    dispatcher.send_generate(GenerateTaskMessage(run=RUN_A, task_id="gen-run-a-0-1", groups=[group]))
    dispatcher.send_optimize(OptimizeTaskMessage(run=RUN_A, step=1, base_version=0))
    repair_a = RepairTaskMessage(run=RUN_A, version=3, key="runs/run-a/adapters/v3/manifest.json", manifest_sha256=SHA)
    dispatcher.send_repair(repair_a, WORKER_ID)
    a_queues = [generate_queue(RUN_A), *worker_queues_of(RUN_A)]
    assert [broker.llen(queue) for queue in a_queues] == [1, 1, 1]
    # A message of run A put into run B's queue by hand (no proxy does that): B's worker must refuse it.
    dispatcher.app.send_task(
        REPAIR_TASK_NAME,
        kwargs=repair_a.model_dump(mode="json"),
        queue=worker_queue(RUN_B, WORKER_ID),
        task_id="stray-of-run-a",
    )
    # Then run B's own repair: queues are first in, first out, so once it ran, the stray was handled first.
    repair_b = RepairTaskMessage(run=RUN_B, version=5, key="runs/run-b/adapters/v5/manifest.json", manifest_sha256=SHA)
    dispatcher.send_repair(repair_b, WORKER_ID)

    env = {
        **os.environ,
        "ASYNCGRPO_RUN": RUN_B,
        "ASYNCGRPO_REDIS_URL": redis_url,
        "ASYNCGRPO_BUCKET": f"file://{tmp_path / 'bucket'}",
        "ASYNCGRPO_PROXY_URL": f"http://127.0.0.1:{free_port()}",  # no proxy: heartbeats fail, and are only logged
        "ASYNCGRPO_WORKER_ID": WORKER_ID,
        "ASYNCGRPO_HEARTBEAT_S": "60",
        "ASYNCGRPO_CACHE": str(tmp_path / "cache"),
        "ASYNCGRPO_TORCH_THREADS": "1",
        "ASYNCGRPO_LOG_FORMAT": "json",
    }
    log_path = tmp_path / "worker-b.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "cli", "worker", "optimize"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not any(e.get("event") == "optimize.repair_done" for e in _log_events(log_path)):
            assert process.poll() is None, f"the worker exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"run B's repair never ran: {log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        events = _log_events(log_path)
        ran = [(e.get("run"), e.get("version")) for e in events if e.get("event") == "optimize.repair_done"]
        assert ran == [(RUN_B, 5)], "only run B's own task ran"
        (refused,) = [e for e in events if e.get("event") == "worker.task_refused"]
        assert (refused["task_run"], refused["worker_run"]) == (RUN_A, RUN_B)
        # Run A's messages are all still queued for run A's workers; B's worker took nothing of A's.
        assert [broker.llen(queue) for queue in a_queues] == [1, 1, 1]
        assert broker.llen(worker_queue(RUN_B, WORKER_ID)) == 0
        assert not broker.exists("generate", "optimize", f"optimize.{WORKER_ID}"), "no queue without a run"

        # Remote control is per run too: run B's `celery inspect` reaches B's worker, run A's does not.
        replies: list = []
        while not replies:
            assert time.monotonic() < deadline, f"no answer to run B's ping: {log_path.read_text()[-3000:]}"
            replies = _inspect_client(redis_url, RUN_B).control.ping(timeout=2)
        assert _inspect_client(redis_url, RUN_A).control.ping(timeout=2) == []
    finally:
        stop_process_group(process)
