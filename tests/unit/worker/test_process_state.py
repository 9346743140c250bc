"""What a worker process keeps between tasks lives on objects it owns, not in module globals: two of each keep
their own state (the held version, the rescoring weights, the preemption state, the ranks, the runtime, the
math-verify helper)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from celery.worker import state as worker_state

from asyncgrpo.bucket.backends import open_bucket
from asyncgrpo.bucket.layout import read_manifest, write_version
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.schemas import RepairTaskMessage
from worker.algo.math_scoring import MathVerifier
from worker.optimize.job import HeldVersion
from worker.optimize.rescore import RecentAdapterWeights
from worker.process.celery_app import WorkerApp
from worker.process.preemption import COOPERATIVE_GRACE_S, Preemption, WorkerPreempted
from worker.process.runtime import WorkerRuntime, get_runtime
from worker.process.settings import WorkerSettings


def test_two_held_versions_repair_only_what_each_holds(tmp_path: Path) -> None:
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    files = {"adapter_model.safetensors": b"weights", "adapter_config.json": b"{}"}
    _, sha = write_version(bucket, "r", 1, files, {})
    manifest, _ = read_manifest(bucket, "r", 1)
    holder, other = HeldVersion(), HeldVersion()
    holder.hold("r", manifest, sha, files)
    key = manifest.file_key("r", "adapter_model.safetensors")
    bucket.put(key, b"rotten")
    message = RepairTaskMessage(run="r", version=1, key=key, manifest_sha256=sha)
    assert (holder.version, other.version) == (1, None)
    assert other.repair(bucket, message) == "not_held"
    assert holder.repair(bucket, message) == "repaired" and bucket.get(key) == b"weights"
    assert holder.repair(bucket, message.model_copy(update={"run": "other-run"})) == "not_held"


def test_two_rescoring_caches_keep_their_own_weights_and_forget_outside_the_window() -> None:
    first, second = RecentAdapterWeights(), RecentAdapterWeights()
    first.remember("r", 1, b"v1")
    first.remember("r", 2, [torch.zeros(2)])
    first.remember("s", 2, b"other run")
    assert second.get("r", 1) is None and second.versions("r") == []
    assert first.get("r", 1) == b"v1" and first.versions("r") == [1, 2]
    first.keep_from("r", 2)  # only the window can be claimed again, and only this run's
    assert first.versions("r") == [2] and first.versions("s") == []
    first.forget("r", 2)
    assert first.versions("r") == []


def test_two_preemptions_hand_back_only_their_own_running_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_state, "should_stop", None)
    idle, busy = Preemption(), Preemption()
    with busy.running():
        assert (busy.task_running, idle.task_running) == (True, False)
        idle._on_terminate(signal.SIGTERM, None)  # nothing running there: it only stops taking tasks
        assert worker_state.should_stop == 0
        with pytest.raises(WorkerPreempted, match="signal"):
            busy._on_terminate(signal.SIGTERM, None)  # grace 0: handed back at once
    assert busy.task_running is False


def test_a_task_that_stops_by_itself_is_asked_to_and_interrupted_only_if_it_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A generate task saving partial sequences (worker.generate.partial) stops at its next decode step: with the
    grace period at 0 a SIGTERM only asks it to, the timer set to COOPERATIVE_GRACE_S as the backstop."""
    monkeypatch.setattr(worker_state, "should_stop", None)
    timers: list[float] = []
    monkeypatch.setattr(signal, "setitimer", lambda _which, seconds: timers.append(seconds))
    preemption = Preemption()
    with preemption.running():
        with preemption.stop.cooperating():
            assert not preemption.stop.requested
            preemption._on_terminate(signal.SIGTERM, None)  # grace 0, yet no WorkerPreempted
            assert preemption.stop.requested
        assert timers == [COOPERATIVE_GRACE_S]
        with pytest.raises(WorkerPreempted, match="grace period"):
            preemption._on_grace_over(signal.SIGALRM, None)  # it did not stop: interrupted after all
    assert not preemption.stop.requested, "the next task starts with no stop requested"
    assert timers[-1] == 0  # disarmed when the task ended


def test_a_runtime_is_kept_on_its_own_app_and_joins_its_ranks_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCGRPO_BUCKET", f"file://{tmp_path / 'bucket'}")
    monkeypatch.setenv("ASYNCGRPO_CACHE", str(tmp_path / "cache"))
    one, two = WorkerApp("one"), WorkerApp("two")
    runtime = get_runtime("optimize", one)
    assert get_runtime("optimize", one) is runtime and get_runtime("optimize", two) is not runtime
    assert one.runtime is runtime and two.runtime is not None
    ranks = runtime.join_ranks()
    assert runtime.join_ranks() is ranks and (ranks.world, ranks.rank) == (1, 0)
    settings = WorkerSettings(bucket=f"file://{tmp_path / 'bucket'}", cache=tmp_path / "cache")
    other = WorkerRuntime("optimize", settings, open_bucket(settings.bucket), ProxyClient("http://127.0.0.1:9", "t"))
    assert other.ranks is None and other.optimizer is None and other.preemption is not runtime.preemption


@pytest.mark.processes
def test_two_runtimes_hold_their_own_math_verifier_which_starts_nothing_until_it_scores(tmp_path: Path) -> None:
    settings = WorkerSettings(bucket=f"file://{tmp_path / 'bucket'}", cache=tmp_path / "cache")
    client = ProxyClient("http://127.0.0.1:9", "t")
    one, two = (WorkerRuntime("generate", settings, open_bucket(settings.bucket), client) for _ in range(2))
    assert isinstance(one.math_verifier, MathVerifier) and one.math_verifier is not two.math_verifier
    assert one.math_verifier.pid is None and two.math_verifier.pid is None  # no helper process yet
    pytest.importorskip("math_verify")
    try:
        assert one.math_verifier.score("2", "$2$") == 1.0
        assert one.math_verifier.pid is not None and two.math_verifier.pid is None
    finally:
        one.math_verifier.close()
    assert one.math_verifier.pid is None


@pytest.mark.processes
def test_the_worker_shutdown_closes_its_runtimes_math_verifier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("math_verify")
    from worker.process import tasks
    from worker.process.celery_app import app

    monkeypatch.setattr(tasks, "_role", lambda: "generate")  # the process's settings are parsed once
    settings = WorkerSettings(bucket=f"file://{tmp_path / 'bucket'}", cache=tmp_path / "cache")
    runtime = WorkerRuntime("generate", settings, open_bucket(settings.bucket), ProxyClient("http://127.0.0.1:9", "t"))
    monkeypatch.setattr(app, "runtime", runtime)
    try:
        assert runtime.math_verifier.score("2", "$2$") == 1.0
        helper = runtime.math_verifier.pid
        assert helper is not None
        tasks._on_worker_shutdown()
        assert runtime.math_verifier.pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(helper, 0)  # killed and reaped
    finally:
        runtime.math_verifier.close()
