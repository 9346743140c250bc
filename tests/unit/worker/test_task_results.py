"""The Celery task wrapper's end of a task (``worker.process.tasks``): a task whose body finished is done, whatever
its summary holds. An eval task's result is stored before its summary is logged: a failure in between used to
be reported to the proxy as the task's failure (every eval task, ``task_error_TypeError``), so the proxy sent it
again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog

from asyncgrpo.bucket.backends import open_bucket
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.schemas import TaskFailureReport, TaskFailureResult
from worker.generate.evals import EvalResult
from worker.generate.job import GenerateResult
from worker.optimize.job import OptimizeResult
from worker.process import metrics as worker_metrics
from worker.process import tasks
from worker.process.celery_app import app
from worker.process.runtime import WorkerRuntime
from worker.process.settings import WorkerSettings


class ReportingClient(ProxyClient):
    """The real client, with the one call the wrapper makes on a failure kept instead of sent."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9", "token")
        self.reports: list[tuple[str, TaskFailureReport]] = []

    def report_task_failure(self, task_id: str, report: TaskFailureReport) -> TaskFailureResult:
        self.reports.append((task_id, report))
        return TaskFailureResult(cancelled=True)


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> WorkerRuntime:
    settings = WorkerSettings(bucket=f"file://{tmp_path / 'bucket'}", worker_id="gen-t", cache=tmp_path / "cache")
    bucket, client = open_bucket(settings.bucket), ReportingClient()
    made = WorkerRuntime(role="generate", settings=settings, bucket=bucket, client=client)
    monkeypatch.setattr(app, "runtime", made)
    return made


def _count(name: str, **labels: str) -> float:
    return worker_metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_an_eval_task_that_recorded_its_result_ends_as_done_and_reports_nothing(runtime: WorkerRuntime) -> None:
    summary = EvalResult("eval-r-v2-0", "recorded", 2, prompts=3, chunks_left=1, reward_mean=0.5).summary()
    errors_before = sum(_count("asyncgrpo_worker_errors_total", kind=k) for k in worker_metrics.ERROR_KINDS)
    with structlog.testing.capture_logs() as logs:
        answer = tasks._run_generate_role(lambda _: summary, task_id="eval-r-v2-0", version=2)
    assert answer == summary and answer["status"] == "recorded"
    assert runtime.client.reports == []  # type: ignore[attr-defined]
    done = [line for line in logs if line["event"] == "generate.task_done"]
    assert len(done) == 1 and done[0]["status"] == "recorded" and done[0]["seconds"] >= 0
    assert not [line for line in logs if line["event"] in {"worker.task_failed", "generate.task_failure_reported"}]
    assert sum(_count("asyncgrpo_worker_errors_total", kind=k) for k in worker_metrics.ERROR_KINDS) == errors_before


@pytest.mark.parametrize(
    "summary",
    [
        EvalResult("t", "recorded", 1).summary(),
        GenerateResult("t", "admitted", 1, groups=1, samples=2, tokens=3, reused_rollout=False).summary(),
        OptimizeResult(step=1, status="published", version=1).summary(),
    ],
    ids=["evaluate", "generate", "optimize"],
)
def test_the_task_line_keeps_the_wrappers_wall_time_for_every_summary(
    runtime: WorkerRuntime, summary: dict[str, Any]
) -> None:
    with structlog.testing.capture_logs() as logs:
        assert tasks._run("generate", "t", lambda _: {**summary, "seconds": -1.0}) == {**summary, "seconds": -1.0}
    (done,) = [line for line in logs if line["event"] == "generate.task_done"]
    assert done["seconds"] >= 0  # the wrapper's, not the summary's


def test_a_task_whose_body_fails_is_reported_once(runtime: WorkerRuntime) -> None:
    def body(_: WorkerRuntime) -> dict[str, Any]:
        raise ValueError("the chunk's prompts do not parse")

    answer = tasks._run_generate_role(body, task_id="eval-r-v2-1", version=2)
    assert answer["status"] == "failed" and answer["reason"] == "task_error_ValueError"
    assert [task_id for task_id, _ in runtime.client.reports] == ["eval-r-v2-1"]  # type: ignore[attr-defined]
