"""The proxy's own metrics: run limits, publish-to-first-use latency, the bottleneck pair, HTTP errors by code.

A real coordinator on a private Redis with the ManualClock, so every second counted here is one the test
moved the clock by. Values are read from the proxy's registry or from the /metrics text the app serves.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from asyncgrpo.protocol.schemas import FleetView, HeartbeatRequest
from proxy.api.app import create_app
from proxy.coordinator.metrics import HTTP_ERROR_CODES, StateGauges
from proxy.coordinator.service import Coordinator
from tests.support.fixtures_coordinator import API_TOKEN
from tests.support.paths import REPO_ROOT
from tests.support.proxy_harness import (
    ManualClock,
    advance_version,
    file_bucket,
    make_coordinator,
    paced_coordinator,
    publish_next,
    publish_request,
    small_config,
    step_at_pace,
    submission,
    write_fake_version,
)

TOKEN = API_TOKEN
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start(coord: Coordinator) -> None:
    """Init step claimed and published as v0, then the buffer filled with generate tasks."""
    coord.tick()
    publish_next(coord)
    coord.tick()


def scraped(http: TestClient) -> dict[str, float]:
    """Sample name (with labels, if any) -> value, parsed from the /metrics text."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def first_use(coord: Coordinator) -> tuple[float, float]:
    """(observations, sum of seconds) of asyncgrpo_version_first_use_seconds."""
    registry = coord.metrics.registry
    count = registry.get_sample_value("asyncgrpo_version_first_use_seconds_count") or 0.0
    return count, registry.get_sample_value("asyncgrpo_version_first_use_seconds_sum") or 0.0


def waited_ms(coord: Coordinator) -> tuple[int, int]:
    """(dispatch backpressure, trainer starved) in milliseconds, as /v1/status counts them."""
    counters = coord.status().counters
    return counters.get("dispatch_backpressure_ms", 0), counters.get("trainer_starved_ms", 0)


# ---- limits ----


def test_run_limits_are_gauges(redis_client: Redis, tmp_path: Path) -> None:
    config = small_config(max_staleness=3, queue_maxsize=12, groups_per_step=6, groups_per_task=3)
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=config)
    with TestClient(create_app(coord, TOKEN, run_loop=False)) as http:
        metrics = scraped(http)
    assert metrics["asyncgrpo_max_staleness_versions"] == 3
    assert metrics["asyncgrpo_queue_maxsize_groups"] == 12
    assert metrics["asyncgrpo_groups_per_step"] == 6
    assert metrics["asyncgrpo_final_version"] == config.final_version


# ---- publish to first use ----


def test_first_lease_on_each_version_observes_seconds_since_its_publish(
    coord: Coordinator, clock: ManualClock, redis_client: Redis
) -> None:
    start(coord)
    assert first_use(coord) == (0.0, 0.0), "publishing alone observes nothing"
    clock.advance(3)
    coord.lease("gen-1", "t1")
    assert first_use(coord) == (1.0, 3.0)
    clock.advance(10)
    coord.lease("gen-2", "t2")
    assert first_use(coord) == (1.0, 3.0), "only the first lease of a version counts"

    # v1: claimed from a full buffer and published; first leased 1.5 s later.
    for task in list(coord.dispatcher.generate):
        coord.submit(submission(coord, task, 0))
    coord.tick()
    publish_next(coord)
    clock.advance(1.5)
    assert coord.lease("gen-1", "t3").version == 1
    assert first_use(coord) == (2.0, 4.5)

    # A restarted proxy (a new process on the same Redis) does not count v1's first use again.
    again = make_coordinator(redis_client, coord.bucket, clock=clock)
    again.lease("gen-1", "t4")
    assert first_use(again) == (0.0, 0.0)


def test_first_use_is_skipped_when_the_publish_time_is_unknown(coord: Coordinator, clock: ManualClock) -> None:
    start(coord)
    coord.redis.delete(coord.keys.step(0))  # the record expired, or Redis was rebuilt without it
    clock.advance(2)
    grant = coord.lease("gen-1", "t1")
    assert grant.version == 0 and first_use(coord) == (0.0, 0.0)
    assert not coord.redis.exists(coord.keys.step(0)), "no stub record is left behind"


# ---- the bottleneck pair ----


def test_full_buffer_and_no_step_count_backpressure_and_starvation(coord: Coordinator, clock: ManualClock) -> None:
    start(coord)
    cfg = coord.config.async_
    status = coord.status()
    assert status.groups_inflight == cfg.queue_maxsize and status.step_inflight is None
    coord.tick()  # first tick of the window: nothing to credit yet beyond what start() saw
    before = waited_ms(coord)
    clock.advance(5)
    coord.tick()
    backpressure, starved = waited_ms(coord)
    # Every generate task is out (the buffer is full) and nothing is buffered: both clocks run.
    assert backpressure - before[0] == 5000 and starved - before[1] == 5000


def test_step_in_flight_with_full_buffer_is_backpressure_only(coord: Coordinator, clock: ManualClock) -> None:
    start(coord)
    for task in list(coord.dispatcher.generate):
        coord.submit(submission(coord, task, 0))
    coord.tick()  # claims step 1 and refills the buffer
    assert coord.status().step_inflight == 1
    before = waited_ms(coord)
    clock.advance(7)
    coord.tick()
    clock.advance(2)
    coord.tick()
    after = waited_ms(coord)
    assert after[0] - before[0] == 9000, "the trainer is the bottleneck: dispatch is held back"
    assert after[1] == before[1], "a step is in flight, so the trainer is not starved"


def test_broker_down_starves_the_trainer_without_backpressure(coord: Coordinator, clock: ManualClock) -> None:
    coord.tick()
    publish_next(coord)
    coord.dispatcher.fail = True  # generate tasks cannot be sent: the buffer stays empty
    coord.tick()
    assert coord.status().groups_inflight == 0
    before = waited_ms(coord)
    clock.advance(4)
    coord.tick()
    after = waited_ms(coord)
    assert after[1] - before[1] == 4000 and after[0] == before[0]


def test_finished_run_counts_neither(redis_client: Redis, tmp_path: Path, clock: ManualClock) -> None:
    base = small_config()
    config = base.model_copy(update={"optimizer": base.optimizer.model_copy(update={"total_steps": 1})})
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=config, clock=clock)
    start(coord)
    for task in list(coord.dispatcher.generate):
        coord.submit(submission(coord, task, 0))
    coord.tick()
    publish_next(coord)
    assert coord.status().finished
    coord.tick()
    before = waited_ms(coord)
    clock.advance(60)
    coord.tick()
    assert waited_ms(coord) == before


def test_waiting_totals_survive_a_proxy_restart_and_show_in_metrics(
    coord: Coordinator, clock: ManualClock, redis_client: Redis, http: TestClient
) -> None:
    start(coord)
    coord.tick()
    clock.advance(5)
    coord.tick()
    total = waited_ms(coord)
    assert total[0] >= 5000 and total[1] >= 5000
    metrics = scraped(http)
    assert metrics["asyncgrpo_dispatch_backpressure_seconds_total"] == total[0] / 1000
    assert metrics["asyncgrpo_trainer_starved_seconds_total"] == total[1] / 1000

    restarted = make_coordinator(redis_client, coord.bucket, clock=clock)
    clock.advance(30)
    restarted.tick()  # the gap before a process's first tick is unknown: not credited
    assert waited_ms(restarted) == total
    clock.advance(2)
    restarted.tick()
    assert waited_ms(restarted) == (total[0] + 2000, total[1] + 2000)


# ---- the autoscaling signal ----


def test_generate_workers_wanted_follows_the_measured_rates_and_drops_to_zero_when_finished(
    redis_client: Redis, tmp_path: Path, clock: ManualClock
) -> None:
    coord = paced_coordinator(redis_client, file_bucket(tmp_path), clock)
    fleet_names = (
        "asyncgrpo_generate_workers_wanted",
        "asyncgrpo_generate_workers_submitting",
        "asyncgrpo_pacing_step_seconds",
        "asyncgrpo_pacing_generate_task_seconds",
        "asyncgrpo_pacing_tasks_per_version",
    )
    with TestClient(create_app(coord, API_TOKEN, run_loop=False)) as http:
        assert not set(fleet_names) & set(scraped(http)), "unmeasured: no series, not a guess"
        assert coord.status().fleet is None
        submitted: set[str] = set()
        advance_version(coord, submitted)  # version 0
        for step in range(1, 6):
            # Two workers; each task takes 0.99 s from lease to submission, each step 1.6 s to publish.
            assert step_at_pace(coord, clock, submitted, task_s=0.99, step_s=1.6, workers=2) == step
            if step == 4:
                # 4 tasks per version at 0.99 s + 0.01 s delivery against 1.6 s steps: 2.5, so 3 workers.
                metrics = scraped(http)
                assert [metrics[name] for name in fleet_names] == [3.0, 2.0, 1.6, 0.99, 4.0]
                assert coord.status().fleet == FleetView(
                    wanted=3, submitting=2, step_s=1.6, task_s=0.99, tasks_per_version=4
                )
        assert coord.status().finished
        assert scraped(http)["asyncgrpo_generate_workers_wanted"] == 0.0, "a finished run wants no generators"
        assert coord.status().fleet is not None and coord.status().fleet.wanted == 0


# ---- HTTP errors ----


def test_http_errors_are_counted_by_code(coord: Coordinator, http: TestClient) -> None:
    def errors() -> dict[str, float]:
        metrics = scraped(http)
        return {code: metrics[f'asyncgrpo_http_errors_total{{error="{code}"}}'] for code in HTTP_ERROR_CODES}

    assert set(errors().values()) == {0.0}, "every code is exported from the start"
    answer = http.post("/v1/leases", json={"worker_id": "w", "task_id": "t"}, headers=AUTH)
    assert answer.status_code == 409 and answer.json()["error"] == "not_ready"
    start(coord)
    sha = write_fake_version(coord.bucket, coord.run, 1)
    answer = http.post("/v1/versions", json=publish_request(1, sha).model_dump(mode="json"), headers=AUTH)
    assert answer.status_code == 409 and answer.json()["error"] == "conflict"
    assert http.post("/v1/versions", json={}, headers=AUTH).status_code == 422
    assert http.post("/v1/versions", json={}).status_code == 401
    assert http.get("/v1/steps/42", headers=AUTH).status_code == 404
    counted = errors()
    assert counted == {code: 0.0 for code in HTTP_ERROR_CODES} | {
        "not_ready": 1.0,
        "conflict": 1.0,
        "bad_request": 1.0,
        "unauthorized": 1.0,
        "not_found": 1.0,
    }


# ---- exposition format ----


def test_promtool_accepts_the_served_metrics(coord: Coordinator, clock: ManualClock, http: TestClient) -> None:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    start(coord)
    clock.advance(1)
    coord.lease("gen-1", "t1")
    coord.tick()
    http.get("/v1/steps/42", headers=AUTH)
    text = http.get("/metrics").text
    for name in (
        "asyncgrpo_max_staleness_versions",
        "asyncgrpo_version_first_use_seconds_bucket",
        "asyncgrpo_dispatch_backpressure_seconds_total",
        "asyncgrpo_trainer_starved_seconds_total",
        "asyncgrpo_http_errors_total",
    ):
        assert name in text, name
    check = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


# ---- the staleness alert follows the exported limit ----

RULES = REPO_ROOT / "deploy" / "prometheus" / "asyncgrpo-alerts.yml"


def staleness_case(limit: int, staleness: int, fires: bool, description: str) -> dict:
    """A promtool unit-test group: every consumed sample is ``staleness`` versions old for an hour."""
    bucket = 'asyncgrpo_sample_staleness_versions_bucket{job="asyncgrpo-proxy",le="%s"}'
    bounds = [b for b in (0, 1, 2, 3, 4) if b < staleness] + [staleness]
    series = [{"series": bucket % f"{b:.1f}", "values": "0x60" if b < staleness else "0+10x60"} for b in bounds]
    series.append({"series": bucket % "+Inf", "values": "0+10x60"})
    series.append({"series": 'asyncgrpo_max_staleness_versions{job="asyncgrpo-proxy"}', "values": f"{limit}x60"})
    # Prometheus interpolates inside the bucket (staleness - 1, staleness]: the 90th percentile is s - 0.1.
    p90 = 0.0 if staleness == 0 else staleness - 0.1
    expected = (
        [
            {
                "exp_labels": {"severity": "warning"},
                "exp_annotations": {
                    "summary": f"90th percentile of consumed staleness is at the limit ({p90:.1f} versions)",
                    "description": description,
                },
            }
        ]
        if fires
        else []
    )
    return {
        "interval": "1m",
        "name": f"limit {limit}, samples {staleness} behind",
        "input_series": series,
        "alert_rule_test": [{"eval_time": "40m", "alertname": "AsyncgrpoStalenessNearMax", "exp_alerts": expected}],
    }


def test_staleness_alert_uses_the_exported_limit(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    rules = yaml.safe_load(RULES.read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "AsyncgrpoStalenessNearMax"]
    assert "asyncgrpo_max_staleness_versions" in rule["expr"]
    description = rule["annotations"]["description"]
    cases = [
        staleness_case(2, 2, True, description),  # at the limit
        staleness_case(2, 1, False, description),  # one version inside it
        staleness_case(1, 1, True, description),  # the limit comes from the gauge, not a fixed number
        staleness_case(3, 2, False, description),
        staleness_case(0, 0, False, description),  # max_staleness = 0: every sample is "at" the limit
    ]
    spec = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": cases}
    spec_path = tmp_path / "staleness_test.yml"
    spec_path.write_text(yaml.safe_dump(spec))
    check = subprocess.run([tool, "test", "rules", str(spec_path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def _commands_processed(redis_client: Redis) -> int:
    return int(redis_client.info("stats")["total_commands_processed"])


def test_scrape_gauges_agree_with_status_and_cost_the_same_with_many_leases_and_workers(
    coord: Coordinator, clock: ManualClock, redis_client: Redis
) -> None:
    start(coord)
    report = HeartbeatRequest(worker_id="gen-0", role="generate", hostname="h", pid=1, state="idle")
    coord.heartbeat(report.model_copy(update={"worker_id": "trainer", "role": "optimize"}))
    clock.advance(31)  # the trainer is no longer alive; its record stays listed
    costs = []
    for workers in (1, 60):
        for index in range(workers):
            coord.heartbeat(report.model_copy(update={"worker_id": f"gen-{index}"}))
            coord.lease(f"gen-{index}", "t")
        # A role change moves the worker between the role sets.
        coord.heartbeat(report.model_copy(update={"worker_id": "gen-0", "role": "optimize"}))
        coord.heartbeat(report)
        assert coord.gauges() == StateGauges.from_status(coord.status())
        before = _commands_processed(redis_client)
        coord.gauges()
        costs.append(_commands_processed(redis_client) - before)
    gauges = coord.gauges()
    assert gauges.workers_alive_by_role == {"generate": 60}
    assert gauges.leases_active == 61
    assert costs[0] == costs[1], f"a scrape read {costs} Redis commands with 1 and 60 workers"
    clock.advance(coord.config.async_.lease_ttl_s + 1)
    assert coord.gauges().leases_active == 0 == len(coord.status().leases)
