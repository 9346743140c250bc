"""Worker metrics move when the tasks report, from a real GenerateResult and a real optimize step record."""

from __future__ import annotations

import math
import shutil
import subprocess

import httpx
import pytest

from asyncgrpo.protocol.records import (
    AgentStats,
    CorrectionFigures,
    FlaggedRollout,
    GenerateTimings,
    StepRecord,
    StepTimings,
    ToolFigures,
    UpdateMetrics,
)
from asyncgrpo.protocol.schemas import GroupRef
from tests.support.fixtures_redis import free_port
from worker.algo.rollout import Rollout, RolloutSample
from worker.generate.job import GenerateResult
from worker.optimize.job import build_step_record
from worker.process import metrics as result_metrics
from worker.process import metrics as wm


def value(name: str, **labels: str) -> float:
    """Current value of a sample of the worker registry (0 when it has no sample yet)."""
    found = wm.REGISTRY.get_sample_value(name, labels)
    return 0.0 if found is None else found


def _sample(group: int, tokens: int, reward: float, finish: str = "stop") -> RolloutSample:
    return RolloutSample(
        group_index=group,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=list(range(tokens)),
        behavior_logprobs=[-0.5] * tokens,
        reward=reward,
        advantage=0.0,
        finish_reason=finish,
        rewards_by_name={"repeat_digit": reward, "format": reward / 2},
    )


def _rollout(task_id: str, version: int, samples: list[RolloutSample]) -> Rollout:
    return Rollout(
        run="r1",
        task_id=task_id,
        version=version,
        worker_id="gen-1",
        groups=[GroupRef(group_id=f"{task_id}-g0", prompt_index=0)],
        samples=samples,
    )


def _update(index: int, fb_s: float, opt_s: float) -> UpdateMetrics:
    return UpdateMetrics(
        update=index,
        loss=0.25,
        ratio=1.01,
        kl=0.002,
        clip_low=0.01,
        clip_high=0.03,
        clip_region=0.04,
        entropy=1.5,
        grad_norm=0.7,
        lr=5e-3,
        tokens=10,
        sequences=5,
        micro_batches=1,
        forward_backward_s=fb_s,
        optimizer_s=opt_s,
    )


def step_record() -> StepRecord:
    """A step record as the optimize job builds it: base version 5, one rollout of v4 (3 samples), one of v5 (2)."""
    old = _rollout("t-old", 4, [_sample(0, 4, 1.0), _sample(0, 6, 0.0, "length"), _sample(0, 2, 0.5)])
    new = _rollout("t-new", 5, [_sample(0, 3, 1.0), _sample(0, 5, 1.0)])
    return build_step_record(
        run="r1",
        step=6,
        base_version=5,
        worker_id="trainer-1",
        rollouts=[old, new],
        ratios=[1.2, 1.0],
        flagged=[FlaggedRollout(task_id="t-old", worker_id="gen-1", ratio=1.2)],
        updates=[_update(10, 0.3, 0.05), _update(11, 0.2, 0.04)],
        timings=StepTimings(fetch_s=0.02, rescore_s=0.1, step_s=2.0, upload_s=0.15),
    )


def test_generate_task_summary_moves_generate_metrics() -> None:
    result = GenerateResult(
        task_id="task-1",
        status="admitted",
        version=7,
        groups=4,
        samples=32,
        tokens=480,
        reused_rollout=False,
        timings=GenerateTimings(adapter_fetch_s=0.05, generate_s=2.0, score_s=0.1, task_s=4.0),
        reward_mean=0.75,
    )
    before = {
        "tasks": value("asyncgrpo_generate_tasks_total", status="admitted"),
        "tokens": value("asyncgrpo_generate_tokens_total"),
        "samples": value("asyncgrpo_generate_samples_total"),
        "groups": value("asyncgrpo_generate_groups_total"),
        "task_count": value("asyncgrpo_generate_task_seconds_count"),
        "task_sum": value("asyncgrpo_generate_task_seconds_sum"),
        "fetch_sum": value("asyncgrpo_generate_adapter_fetch_seconds_sum"),
    }
    result_metrics.observe_generate_task(result)
    assert value("asyncgrpo_generate_tasks_total", status="admitted") == before["tasks"] + 1
    assert value("asyncgrpo_generate_tokens_total") == before["tokens"] + 480
    assert value("asyncgrpo_generate_samples_total") == before["samples"] + 32
    assert value("asyncgrpo_generate_groups_total") == before["groups"] + 4
    assert value("asyncgrpo_generate_task_seconds_count") == before["task_count"] + 1
    assert value("asyncgrpo_generate_task_seconds_sum") == pytest.approx(before["task_sum"] + 4.0)
    assert value("asyncgrpo_generate_adapter_fetch_seconds_sum") == pytest.approx(before["fetch_sum"] + 0.05)
    assert value("asyncgrpo_generate_tokens_per_second") == pytest.approx(480 / 2.0)
    assert value("asyncgrpo_generate_samples_per_second") == pytest.approx(32 / 4.0)
    assert value("asyncgrpo_generate_version") == 7
    assert value("asyncgrpo_generate_reward_mean") == pytest.approx(0.75)


def test_reused_and_stale_tasks_count_without_inflating_throughput() -> None:
    tokens_before = value("asyncgrpo_generate_tokens_total")
    stale_before = value("asyncgrpo_generate_tasks_total", status="stale")
    stale_errors_before = value("asyncgrpo_worker_errors_total", kind="stale")
    reused = GenerateResult(
        task_id="task-2",
        status="stale",
        version=3,
        groups=2,
        samples=16,
        tokens=0,
        reused_rollout=True,
        timings=GenerateTimings(task_s=0.2),
    )
    result_metrics.observe_generate_task(reused)
    assert value("asyncgrpo_generate_tasks_total", status="stale") == stale_before + 1
    assert value("asyncgrpo_worker_errors_total", kind="stale") == stale_errors_before + 1
    assert value("asyncgrpo_generate_tokens_total") == tokens_before


def test_optimize_step_record_moves_trainer_lag_and_policy_metrics() -> None:
    record = step_record()
    before = {
        "published": value("asyncgrpo_trainer_steps_total", status="published"),
        "tokens": value("asyncgrpo_trainer_tokens_total"),
        "stale_count": value("asyncgrpo_trainer_sample_staleness_versions_count"),
        "stale_sum": value("asyncgrpo_trainer_sample_staleness_versions_sum"),
        "stale_le0": value("asyncgrpo_trainer_sample_staleness_versions_bucket", le="0.0"),
        "fb_sum": value("asyncgrpo_trainer_forward_backward_seconds_sum"),
        "opt_sum": value("asyncgrpo_trainer_optimizer_seconds_sum"),
        "publish_sum": value("asyncgrpo_trainer_publish_seconds_sum"),
        "flagged": value("asyncgrpo_policy_flagged_rollouts_total"),
    }
    result_metrics.observe_optimize_step(record, "published")

    assert value("asyncgrpo_trainer_steps_total", status="published") == before["published"] + 1
    assert value("asyncgrpo_trainer_tokens_total") == before["tokens"] + record.tokens == before["tokens"] + 20
    assert value("asyncgrpo_trainer_tokens_per_second") == pytest.approx(20 / 2.0)
    assert value("asyncgrpo_trainer_samples_per_step") == 5
    assert value("asyncgrpo_trainer_groups_per_step") == 2
    assert value("asyncgrpo_trainer_version") == 6
    # Forward/backward and optimizer time are summed over the step's two optimizer updates.
    assert value("asyncgrpo_trainer_forward_backward_seconds_sum") == pytest.approx(before["fb_sum"] + 0.5)
    assert value("asyncgrpo_trainer_optimizer_seconds_sum") == pytest.approx(before["opt_sum"] + 0.09)
    assert value("asyncgrpo_trainer_publish_seconds_sum") == pytest.approx(before["publish_sum"] + 0.15)
    # One staleness observation per completion: 3 samples 1 version behind, 2 samples fresh.
    assert value("asyncgrpo_trainer_sample_staleness_versions_count") == before["stale_count"] + 5
    assert value("asyncgrpo_trainer_sample_staleness_versions_sum") == before["stale_sum"] + 3
    assert value("asyncgrpo_trainer_sample_staleness_versions_bucket", le="0.0") == before["stale_le0"] + 2
    assert value("asyncgrpo_trainer_step_max_staleness_versions") == 1

    assert value("asyncgrpo_policy_ratio") == pytest.approx(1.01)
    assert value("asyncgrpo_policy_rescore_ratio") == pytest.approx(1.1)
    assert value("asyncgrpo_policy_kl") == pytest.approx(0.002)
    assert value("asyncgrpo_policy_clip_fraction", bound="high") == pytest.approx(0.03)
    assert value("asyncgrpo_policy_clip_fraction", bound="region") == pytest.approx(0.04)
    rewards = [1.0, 0.0, 0.5, 1.0, 1.0]
    mean = sum(rewards) / 5
    assert value("asyncgrpo_policy_reward_mean") == pytest.approx(mean)
    assert value("asyncgrpo_policy_reward_std") == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rewards) / 5))
    assert value("asyncgrpo_policy_reward_function_mean", reward="format") == pytest.approx(mean / 2)
    assert value("asyncgrpo_policy_completion_length_tokens") == pytest.approx(20 / 5)
    assert value("asyncgrpo_policy_truncated_ratio") == pytest.approx(1 / 5)
    assert value("asyncgrpo_policy_flagged_rollouts_total") == before["flagged"] + 1


def test_conflict_without_record_counts_status_and_error() -> None:
    conflicts = value("asyncgrpo_trainer_steps_total", status="conflict")
    errors = value("asyncgrpo_worker_errors_total", kind="conflict")
    steps = value("asyncgrpo_trainer_step_seconds_count")
    result_metrics.observe_optimize_step(None, "conflict")
    assert value("asyncgrpo_trainer_steps_total", status="conflict") == conflicts + 1
    assert value("asyncgrpo_worker_errors_total", kind="conflict") == errors + 1
    assert value("asyncgrpo_trainer_step_seconds_count") == steps


def test_idle_time_goes_to_rollout_wait_or_backpressure() -> None:
    wait = value("asyncgrpo_trainer_rollout_wait_seconds_sum")
    pressure = value("asyncgrpo_generate_backpressure_seconds_sum")
    wm.observe_idle("optimize", 1.5)
    wm.observe_idle("generate", 0.25)
    assert value("asyncgrpo_trainer_rollout_wait_seconds_sum") == pytest.approx(wait + 1.5)
    assert value("asyncgrpo_generate_backpressure_seconds_sum") == pytest.approx(pressure + 0.25)
    with pytest.raises(ValueError, match="role 'proxy' is unknown"):
        wm.observe_idle("proxy", 1.0)
    with pytest.raises(ValueError, match="finite number of seconds"):
        wm.observe_idle("optimize", -1.0)


def test_errors_are_bounded_by_kind() -> None:
    integrity = value("asyncgrpo_worker_errors_total", kind="integrity")
    other = value("asyncgrpo_worker_errors_total", kind="other")
    wm.observe_error("integrity")
    wm.observe_error("task-8c1f-unexpected")  # an unknown kind must not become a new label value
    assert value("asyncgrpo_worker_errors_total", kind="integrity") == integrity + 1
    assert value("asyncgrpo_worker_errors_total", kind="other") == other + 1
    assert wm.REGISTRY.get_sample_value("asyncgrpo_worker_errors_total", {"kind": "task-8c1f-unexpected"}) is None


def test_task_in_flight_and_worker_info() -> None:
    with wm.task_in_flight("generate"):
        assert value("asyncgrpo_worker_tasks_in_flight", role="generate") == 1
    assert value("asyncgrpo_worker_tasks_in_flight", role="generate") == 0
    wm.set_worker_info("optimize", "host-a-optimize", "cuda:0", "Trainer")
    labels = {"role": "optimize", "worker_id": "host-a-optimize", "device": "cuda:0", "backend": "Trainer"}
    assert value("asyncgrpo_worker_info", **labels) == 1
    with pytest.raises(ValueError, match="role"):
        wm.set_worker_info("trainer", "x", "cpu", "none")


def test_endpoint_serves_the_worker_registry_and_promtool_accepts_it(tmp_path) -> None:
    result_metrics.observe_optimize_step(step_record(), "published")
    port = free_port()
    endpoint = wm.MetricsEndpoint()
    endpoint.start(port, addr="127.0.0.1")
    endpoint.start(port, addr="127.0.0.1")  # same port again: a no-op
    with pytest.raises(RuntimeError, match="already serves metrics"):
        endpoint.start(port + 1, addr="127.0.0.1")
    assert (endpoint.port, wm.MetricsEndpoint().port) == (port, None)  # each endpoint's own, not the module's
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert "asyncgrpo_trainer_step_seconds_bucket" in text
    assert "asyncgrpo_generate_backpressure_seconds_count" in text
    assert "process_cpu_seconds_total" in text or "python_info" in text

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus); endpoint served fine")
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_each_role_endpoint_shows_only_its_families() -> None:
    from prometheus_client import generate_latest

    generate_text = generate_latest(wm.role_registry("generate")).decode()
    optimize_text = generate_latest(wm.role_registry("optimize")).decode()
    assert "asyncgrpo_generate_tokens_total" in generate_text and "asyncgrpo_worker_errors_total" in generate_text
    assert "asyncgrpo_policy_ratio" not in generate_text and "asyncgrpo_trainer_" not in generate_text
    assert "asyncgrpo_policy_ratio" in optimize_text and "asyncgrpo_trainer_samples_total" in optimize_text
    assert "asyncgrpo_generate_" not in optimize_text and "asyncgrpo_worker_errors_total" in optimize_text
    with pytest.raises(ValueError, match="role"):
        wm.role_registry("trainer")


def test_the_correction_weights_move_their_gauges_only_when_a_step_corrected() -> None:
    record = step_record()
    record.importance_sampling_ratio = CorrectionFigures(
        min=0.4, mean=1.05, max=2.9, logp_difference_mean=0.03, logp_difference_max=0.7
    )
    result_metrics.observe_optimize_step(record, "published")
    for stat, expected in (("min", 0.4), ("mean", 1.05), ("max", 2.9)):
        assert value("asyncgrpo_policy_importance_sampling_ratio", stat=stat) == pytest.approx(expected)
    assert value("asyncgrpo_policy_sampling_logp_difference", stat="max") == pytest.approx(0.7)
    uncorrected = step_record()  # no correction: the gauges keep the last corrected step's figures
    result_metrics.observe_optimize_step(uncorrected, "published")
    assert value("asyncgrpo_policy_importance_sampling_ratio", stat="mean") == pytest.approx(1.05)


def test_an_agent_step_moves_the_tool_gauges() -> None:
    record = step_record()
    record.tools = ToolFigures.of([AgentStats(turns=[2, 1], tool_calls=[1, 0], tool_failures=[1, 0])])
    result_metrics.observe_optimize_step(record, "published")
    assert value("asyncgrpo_policy_tool_calls_per_completion") == pytest.approx(0.5)
    assert value("asyncgrpo_policy_tool_failure_ratio") == pytest.approx(1.0)
    assert value("asyncgrpo_policy_turns_per_completion") == pytest.approx(1.5)
