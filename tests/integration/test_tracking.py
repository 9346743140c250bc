"""Experiment trackers (proxy.tracking): TRL names, the adapters, and the forwarder against real Redis, a
file:// bucket and real trackio; a tracker that raises is counted and retried and holds nothing up. wandb and
mlflow, real and offline: tests/integration/test_tracker_libraries.py."""

from __future__ import annotations

import sys
import time
import typing
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog
from prometheus_client import CollectorRegistry

from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.protocol.records import AgentStats, CorrectionFigures, ToolFigures
from asyncgrpo.run.config import ConfigError, RunConfig, TrackingConfig, parse_run_config
from proxy.coordinator.redis_store import RunKeys
from proxy.tracking import forwarder as forwarder_module
from proxy.tracking.forwarder import TrackerFollower, TrackerMetrics, build_trackers, start_forwarding
from proxy.tracking.metric_names import eval_metrics, step_metrics
from proxy.tracking.trackers import TRACKERS, Tracker, TrackerRun
from tests.support.tracker_doubles import (
    RUN,
    publish_step,
    put_eval,
    step_record,
    trackio_config,
    trackio_dir,
    trackio_logs,
    wait_until,
)

# ---- names ----


def test_a_step_record_is_sent_under_trl_names_and_missing_values_are_left_out() -> None:
    metrics = step_metrics(step_record(2, entropy=None))
    assert metrics == {
        "reward": 0.5, "reward_std": 0.5, "rewards/repeat_digit/mean": 0.5, "rewards/repeat_digit/std": 0.5,
        "kl": 0.002, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.01, "clip_ratio/region_mean": 0.02,
        "completions/mean_length": 4.5, "completions/clipped_ratio": 0.25, "loss": 0.1, "grad_norm": 0.5,
        "learning_rate": 1e-3,
        "asyncgrpo/optimizer_steps": 4.0, "asyncgrpo/max_staleness": 1.0, "asyncgrpo/mean_staleness": 1.0,
        "asyncgrpo/ratio": 1.0, "asyncgrpo/rescore_ratio": 0.999, "asyncgrpo/tokens": 18.0,
        "asyncgrpo/samples": 4.0, "asyncgrpo/groups": 1.0, "asyncgrpo/flagged_rollouts": 0.0,
        "asyncgrpo/timings/fetch_s": 0.01, "asyncgrpo/timings/step_s": 0.9,
    }  # fmt: skip
    # entropy, the reward with no values and kl_ref (beta = 0) have no value: not logged as 0.


def test_the_correction_weights_are_sent_under_trls_sampling_names() -> None:
    record = step_record(2)
    record.importance_sampling_ratio = CorrectionFigures(
        min=0.5, mean=1.02, max=2.5, logp_difference_mean=0.04, logp_difference_max=0.9
    )
    metrics = step_metrics(record)
    assert {name: value for name, value in metrics.items() if name.startswith("sampling/")} == {
        "sampling/importance_sampling_ratio/min": 0.5,
        "sampling/importance_sampling_ratio/mean": 1.02,
        "sampling/importance_sampling_ratio/max": 2.5,
        "sampling/sampling_logp_difference/mean": 0.04,
        "sampling/sampling_logp_difference/max": 0.9,
    }
    # A record written before the correction existed reads back without it, and sends none of these names.
    assert CorrectionFigures.combine([]) is None
    assert not any(name.startswith("sampling/") for name in step_metrics(step_record(2)))


def test_an_agent_step_s_tool_figures_are_sent_under_trls_tools_names() -> None:
    record = step_record(2)
    stats = [AgentStats(turns=[1, 3, 2, 1], tool_calls=[0, 2, 1, 0], tool_failures=[0, 1, 0, 0])]
    record.tools = ToolFigures.of(stats)
    assert record.tools is not None
    assert (record.tools.calls, record.tools.failures, record.tools.call_rate) == (3, 1, 0.5)
    assert record.tools.turns_mean == pytest.approx(7 / 4)
    metrics = step_metrics(record)
    assert {name: value for name, value in metrics.items() if name.startswith("tools/")} == {
        "tools/call_frequency": pytest.approx(3 / 4),
        "tools/failure_frequency": pytest.approx(1 / 3),
    }
    # A single-turn step has no tools figures and sends none of these names.
    assert ToolFigures.of([]) is None
    assert not any(name.startswith("tools/") for name in step_metrics(step_record(2)))


def test_an_eval_record_is_sent_as_eval_names_numbers_only() -> None:
    record = {"version": 4, "metrics": {"reward": 0.5, "pass@1": 0.25, "n": 64, "note": "x", "bad": float("nan")}}
    assert eval_metrics(record) == {"eval/reward": 0.5, "eval/pass@1": 0.25, "eval/n": 64.0}
    assert eval_metrics({"version": 4}) == {}


# ---- config ----


@pytest.mark.parametrize(
    ("given", "expected"),
    [([], []), ("none", []), (["none"], []), ("trackio", ["trackio"]), (["wandb", "mlflow"], ["wandb", "mlflow"])],
)
def test_report_to_takes_a_name_a_list_or_none(given: object, expected: list[str]) -> None:
    assert TrackingConfig(report_to=given).report_to == expected


@pytest.mark.parametrize(
    ("given", "hint"),
    [
        ({"report_to": "all"}, "list the trackers"),
        ({"report_to": ["trackio", "trackio"]}, "more than once"),
        ({"report_to": ["tensorboard"]}, "'trackio', 'wandb' or 'mlflow'"),
        ({"run_name": "has space"}, "should match pattern"),
    ],
)
def test_bad_tracking_config_names_the_field(given: dict, hint: str) -> None:
    with pytest.raises(ConfigError, match=r"tracking\.(report_to|run_name)") as error:
        parse_run_config({"tracking": given})
    assert hint in str(error.value)


def test_every_choice_of_report_to_has_an_adapter() -> None:
    choices = typing.get_args(typing.get_args(TrackingConfig.model_fields["report_to"].annotation)[0])
    assert set(choices) == set(TRACKERS)


# ---- a tracker library not installed (the real wandb and mlflow: tests/integration/test_tracker_libraries.py) ----


def test_a_tracker_whose_library_is_missing_is_left_out_with_its_extra_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow fails
    config = RunConfig(tracking=TrackingConfig(report_to=["mlflow"]))
    registry = CollectorRegistry()
    with structlog.testing.capture_logs() as logs:
        assert build_trackers(config, RUN, TrackerMetrics(registry)) == []
    missing = {"event": "proxy.tracker_missing", "tracker": "mlflow", "fix": "pip install 'asyncgrpo[mlflow]'"}
    assert missing.items() <= logs[0].items()
    assert registry.get_sample_value("asyncgrpo_tracker_errors_total", {"tracker": "mlflow"}) == 1


# ---- the forwarder: real Redis, a file:// bucket, real trackio ----


def _cursor(redis_client: redis.Redis, tracker: str) -> int:
    return int(redis_client.hget(RunKeys(RUN).tracking, f"{tracker}:step") or 0)


@pytest.fixture
def bucket(tmp_path: Path) -> Bucket:
    return open_bucket(f"file://{tmp_path / 'bucket'}")


def test_trackio_receives_steps_and_evals_in_order_once_across_a_restart(
    redis_client: redis.Redis, bucket: Bucket
) -> None:
    trackio_dir()
    project = f"test-{uuid.uuid4().hex[:8]}"
    config = RunConfig(tracking=TrackingConfig(report_to=["trackio"], project=project))
    for step in (1, 2, 3):
        publish_step(redis_client, bucket, step)
    put_eval(bucket, 0, {"pass@1": 0.125})
    put_eval(bucket, 2, {"pass@1": 0.5})
    put_eval(bucket, 9, {"pass@1": 0.9})  # a version whose step is not sent yet: waits for it

    def start() -> Any:
        registry = CollectorRegistry()
        return registry, start_forwarding(
            config, RUN, redis=redis_client, bucket=bucket, registry=registry, poll_s=0.05
        )

    registry, forwarder = start()
    wait_until(lambda: _cursor(redis_client, "trackio") == 3, "steps 1-3 sent")
    wait_until(lambda: redis_client.hexists(RunKeys(RUN).tracking, "trackio:eval:2"), "eval of version 2 sent")
    forwarder.stop()  # finishes the trackio run: its queue is flushed to the database
    assert registry.get_sample_value("asyncgrpo_tracker_step", {"tracker": "trackio"}) == 3
    assert registry.get_sample_value("asyncgrpo_tracker_errors_total", {"tracker": "trackio"}) == 0

    # A restarted proxy: the same trackio run goes on from step 4, nothing sent twice.
    publish_step(redis_client, bucket, 4)
    registry, forwarder = start()
    wait_until(lambda: _cursor(redis_client, "trackio") == 4, "step 4 sent")
    forwarder.stop()

    rows = trackio_logs(project, RUN)
    train = [row for row in rows if "reward" in row]
    evals = [row for row in rows if "eval/pass@1" in row]
    assert [row["step"] for row in train] == [1, 2, 3, 4]
    assert [row["reward"] for row in train] == [0.25, 0.5, 0.75, 1.0]
    assert train[0]["clip_ratio/region_mean"] == 0.02 and train[0]["completions/mean_length"] == 4.5
    assert [(row["step"], row["eval/pass@1"]) for row in evals] == [(0, 0.125), (2, 0.5)]
    stored = trackio_config(project, RUN)
    assert stored is not None
    assert {key: stored[key] for key in ("optimizer", "tracking", "seed")} == {
        key: config.model_dump(mode="json", by_alias=True)[key] for key in ("optimizer", "tracking", "seed")
    }


class _FlakyTracker(Tracker):
    """Refuses its first start, and every log of step 2; remembers what it took."""

    name = "flaky"
    module = "json"

    def __init__(self) -> None:
        super().__init__(TrackerRun(project="p", name=RUN, config={}))
        self.starts = 0
        self.logged: list[int] = []

    def start(self) -> None:
        self.starts += 1
        if self.starts == 1:
            raise ConnectionError("tracker server unreachable")

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step == 2:
            raise ValueError("tracker refuses this record")
        self.logged.append(step)

    def finish(self) -> None:
        raise RuntimeError("finish fails too")


class _HungTracker(_FlakyTracker):
    name = "hung"

    def start(self) -> None:
        time.sleep(3600)


def test_a_failing_tracker_is_counted_retried_and_holds_nothing_up(
    redis_client: redis.Redis, bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forwarder_module, "FIRST_BACKOFF_S", 0.01)
    monkeypatch.setattr(forwarder_module, "MAX_BACKOFF_S", 0.05)
    trackio_dir()
    project = f"test-{uuid.uuid4().hex[:8]}"
    config = RunConfig(tracking=TrackingConfig(report_to=["trackio"], project=project))
    for step in (1, 2, 3):
        publish_step(redis_client, bucket, step)
    registry = CollectorRegistry()
    metrics = TrackerMetrics(registry)
    flaky, hung = _FlakyTracker(), _HungTracker()
    trackers = [flaky, *build_trackers(config, RUN, metrics), hung]  # the hung one last: stop joins in order
    followers = [
        TrackerFollower(tracker, redis=redis_client, bucket=bucket, run=RUN, metrics=metrics, poll_s=0.05)
        for tracker in trackers
    ]
    with structlog.testing.capture_logs() as logs:
        forwarder = forwarder_module.Forwarder(followers).start()
        wait_until(lambda: _cursor(redis_client, "flaky") == 3 and _cursor(redis_client, "trackio") == 3, "steps sent")
        assert all(follower.alive() for follower in followers)
        started = time.monotonic()
        forwarder.stop(timeout_s=1)
    assert time.monotonic() - started < 5, "a hung tracker held up the stop"

    # The flaky tracker: one failed start, step 2 refused RECORD_ATTEMPTS times then skipped, step 3 sent.
    assert flaky.starts == 2 and flaky.logged == [1, 3]
    errors = 1 + forwarder_module.RECORD_ATTEMPTS + 1  # start, the step-2 logs, finish
    assert registry.get_sample_value("asyncgrpo_tracker_errors_total", {"tracker": "flaky"}) == errors
    failed = [log for log in logs if log["event"] == "proxy.tracker_failed" and log["tracker"] == "flaky"]
    assert [log["phase"] for log in failed] == ["start"] + ["log step 2"] * 5 + ["finish"]
    assert any(log["event"] == "proxy.tracker_record_skipped" and log["record"] == "step 2" for log in logs)
    # The hung one never got past its start; trackio, beside both, got every step.
    assert _cursor(redis_client, "hung") == 0
    assert [row["step"] for row in trackio_logs(project, RUN)] == [1, 2, 3]
