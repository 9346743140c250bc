"""Evaluation during training (``[eval]``) on the proxy: due versions, dispatch, lease, result, record, re-send,
give-up, GC protection, restart and rebuild, the HTTP routes and the ``/metrics`` gauges.

Real private Redis, FileBucket, manual clock, the recording dispatcher (``tests/support/proxy_harness.py``); the
worker's side is played by calling the coordinator (or the HTTP app) the way ``worker.generate.evals`` does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.protocol.evals import EvalChunkSummary, EvalExample, EvalResultRequest, merge_chunks
from asyncgrpo.protocol.records import EvalRecord
from asyncgrpo.protocol.schemas import HeartbeatRequest, TaskFailureReport
from asyncgrpo.run.config import RunConfig
from proxy.api.app import create_app
from proxy.coordinator.evals import due_versions, prompt_chunks
from proxy.coordinator.leases import live_leased_versions
from proxy.coordinator.scripts import EvalEnded, NotTaskHolder
from proxy.coordinator.service import Coordinator
from tests.support.dispatcher import RecordingDispatcher
from tests.support.proxy_harness import ManualClock, SyncCoordinator, advance_version, file_bucket, start_run

TOKEN = "eval-test-token"


def eval_config(every: int = 2, total_steps: int = 8, **eval_fields: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "optimizer": {"total_steps": total_steps},
            "async": {"groups_per_task": 2, "groups_per_step": 4, "queue_maxsize": 8, "max_staleness": 1},
            "eval": {"every_versions": every, "max_prompts_per_task": 2, **eval_fields},
        }
    )


def make(redis_client: Redis, bucket: Bucket, clock: ManualClock, config: RunConfig | None = None) -> Coordinator:
    return SyncCoordinator(
        redis_client,
        bucket,
        "r1",
        config or eval_config(),
        20,
        RecordingDispatcher(),
        clock_ms=clock,
        require_generate_worker=False,
        num_eval_prompts=5,
    )


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def bucket(tmp_path: Path) -> Bucket:
    return file_bucket(tmp_path)


def summary(prompts: int, reward: float, *, k: int = 1) -> EvalChunkSummary:
    """A chunk of ``prompts`` prompts with one completion each, every one scoring ``reward``."""
    return EvalChunkSummary(
        prompts=prompts,
        completions=prompts,
        reward_sum=reward * prompts,
        reward_square_sum=reward * reward * prompts,
        reward_sums={"repeat_digit": reward * prompts},
        pass_at_k_sums={str(k): float(reward >= 1.0) * prompts},
        completion_tokens=4 * prompts,
        examples=[EvalExample(prompt="3=", completion="333", answer="3", reward=reward)],
    )


def eval_all(coord: Coordinator, version: int, reward: float = 0.5, worker: str = "gen-1") -> None:
    """Lease and answer every eval task of ``version`` sent so far (what generate workers do)."""
    for message in [m for m in coord.dispatcher.evals if m["version"] == version]:
        try:
            grant = coord.eval_lease(worker, message["task_id"])
        except EvalEnded:
            continue  # a re-sent copy of a task already answered
        assert grant.version == version and grant.prompt_count == message["prompt_count"]
        request = EvalResultRequest(
            worker_id=worker, lease_id=grant.lease_id, summary=summary(grant.prompt_count, reward)
        )
        coord.eval_result(message["task_id"], request)


def record(coord: Coordinator, version: int) -> EvalRecord | None:
    info = coord.bucket.head(bucket_keys.eval_key(coord.run, version))
    if info is None:
        return None
    return EvalRecord.model_validate_json(coord.bucket.get(bucket_keys.eval_key(coord.run, version)))


def has_version(coord: Coordinator, version: int) -> bool:
    return coord.bucket.head(bucket_keys.manifest_key(coord.run, version)) is not None


# ---- pure logic ----


def test_due_versions_every_k_and_the_final_one() -> None:
    assert due_versions(eval_config(every=2, total_steps=4), 0, 10) == [0, 2, 4]
    assert due_versions(eval_config(every=3, total_steps=4), 0, 10) == [0, 3, 4]
    assert due_versions(eval_config(every=3, total_steps=4), 1, 3) == [3]
    assert due_versions(eval_config(every=3, total_steps=4), 4, 4) == [4]
    assert due_versions(eval_config(every=0, total_steps=4), 0, 10) == []
    assert prompt_chunks(5, 2) == [(0, 2), (2, 2), (4, 1)]


def test_greedy_eval_takes_one_sample_per_prompt() -> None:
    from asyncgrpo.run.config import ConfigError, parse_run_config

    with pytest.raises(ConfigError, match=r"eval: .*eval\.samples_per_prompt = 1"):
        parse_run_config({"eval": {"every_versions": 1, "samples_per_prompt": 4}})
    assert parse_run_config({"eval": {"samples_per_prompt": 4, "temperature": 0.7}}).eval.samples_per_prompt == 4


def test_merge_chunks_weights_by_completions_and_prompts() -> None:
    metrics, examples, prompts = merge_chunks([summary(3, 1.0), summary(1, 0.0)], examples=1)
    assert prompts == 4 and len(examples) == 1
    assert metrics["reward"] == pytest.approx(0.75)
    assert metrics["reward_std"] == pytest.approx(math.sqrt(0.75 - 0.75**2))
    assert metrics["rewards/repeat_digit/mean"] == pytest.approx(0.75)
    assert metrics["pass@1"] == pytest.approx(0.75)
    assert metrics["completions/mean_length"] == pytest.approx(4.0)


# ---- the coordinator ----


def test_due_versions_are_evaluated_once_and_recorded(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord = start_run(make(redis_client, bucket, clock))
    sent = [m["task_id"] for m in coord.dispatcher.evals]
    assert sent == ["eval-r1-v0-0", "eval-r1-v0-1", "eval-r1-v0-2"]  # 5 prompts, 2 per task
    assert coord.status().evals_pending == 1
    eval_all(coord, 0, reward=1.0)
    coord.tick()
    stored = record(coord, 0)
    assert stored is not None and stored.prompts == 5 and stored.metrics["pass@1"] == 1.0
    status = coord.status()
    assert status.evals_pending == 0 and status.eval_latest is not None and status.eval_latest.version == 0
    assert status.counters["eval_versions_done"] == 1 and status.counters["eval_tasks_done"] == 3
    with pytest.raises(EvalEnded):  # a late copy of a task of a recorded version
        coord.eval_lease("gen-2", "eval-r1-v0-1")
    submitted: set[str] = set()
    advance_version(coord, submitted)  # v1: not due
    coord.tick()
    assert len(coord.dispatcher.evals) == 3
    advance_version(coord, submitted)  # v2: due
    coord.tick()
    assert [m["version"] for m in coord.dispatcher.evals[3:]] == [2, 2, 2]


def test_a_pending_eval_keeps_its_version_until_recorded(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    coord = start_run(make(redis_client, bucket, clock))
    submitted: set[str] = set()
    for _ in range(4):  # v4; v0's evaluation never answered
        advance_version(coord, submitted)
    coord.tick()
    assert coord.current_version() == 4
    assert has_version(coord, 0), "a version awaiting its evaluation was collected"
    assert not has_version(coord, 1), "a version no evaluation needs was kept"
    assert has_version(coord, 2)  # due, its tasks sent, not answered
    eval_all(coord, 0)
    coord.tick()
    assert record(coord, 0) is not None and not has_version(coord, 0)  # recorded: collected like any other
    assert coord.status().evals_pending == 2  # v2 and v4


def test_lost_tasks_are_sent_again_then_given_up(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord = start_run(make(redis_client, bucket, clock))
    assert len(coord.dispatcher.evals) == 3
    # A worker leases a task and stops sending heartbeats: its task goes out again before the deadline.
    coord.heartbeat(HeartbeatRequest(worker_id="gen-9", role="generate", hostname="h", pid=1, state="busy"))
    coord.eval_lease("gen-9", "eval-r1-v0-0")
    clock.advance(coord.heartbeats.alive_s + 1)
    coord.tick()
    assert [m["task_id"] for m in coord.dispatcher.evals[3:]] == ["eval-r1-v0-0"]
    timeout = coord.config.async_.generate_task_timeout_s
    for _ in range(coord.config.async_.max_group_attempts):
        clock.advance(timeout + 1)
        coord.tick()
    status = coord.status()
    assert status.counters["eval_versions_failed"] == 1 and status.evals_pending == 0
    assert record(coord, 0) is None
    with pytest.raises(EvalEnded):
        coord.eval_lease("gen-1", "eval-r1-v0-1")


def test_a_reported_failure_sends_the_task_again_at_once(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    # With default timeouts a failing eval task costs one tick, not generate_task_timeout_s (600 s).
    coord = start_run(make(redis_client, bucket, clock))
    sent = len(coord.dispatcher.evals)
    coord.heartbeat(HeartbeatRequest(worker_id="gen-1", role="generate", hostname="h", pid=1, state="busy"))
    coord.eval_lease("gen-1", "eval-r1-v0-0")
    failure = TaskFailureReport(worker_id="gen-2", reason="boom", detail="RuntimeError()")
    assert coord.report_task_failure("eval-r1-v0-0", failure).cancelled is False  # not its holder
    coord.tick()
    assert len(coord.dispatcher.evals) == sent
    failure = TaskFailureReport(worker_id="gen-1", reason="boom", detail="RuntimeError()")
    assert coord.report_task_failure("eval-r1-v0-0", failure).cancelled is True
    clock.advance(1)
    coord.tick()
    assert [m["task_id"] for m in coord.dispatcher.evals[sent:]] == ["eval-r1-v0-0"]
    assert coord.status().counters["eval_tasks_resent"] == 1
    # Reported failures count attempts like lost tasks: at the limit the version's evaluation is given up.
    sends = 2
    while coord.status().counters.get("eval_versions_failed", 0) == 0:
        assert sends <= coord.config.async_.max_group_attempts
        coord.eval_lease("gen-1", "eval-r1-v0-0")
        coord.report_task_failure("eval-r1-v0-0", failure)
        clock.advance(1)
        coord.tick()
        sends += 1
    assert sends == coord.config.async_.max_group_attempts + 1  # given up at the limit, not before
    with pytest.raises(EvalEnded):
        coord.eval_lease("gen-1", "eval-r1-v0-0")


def test_a_result_is_bound_to_the_senders_lease_of_the_task(
    redis_client: Redis, bucket: Bucket, clock: ManualClock
) -> None:
    # As for rollouts: a result under no lease, another worker's lease or another task's lease changes nothing.
    coord = start_run(make(redis_client, bucket, clock))
    first = coord.eval_lease("gen-1", "eval-r1-v0-0")
    other = coord.eval_lease("gen-2", "eval-r1-v0-1")
    before = {key: redis_client.dump(key) for key in sorted(redis_client.keys("*"))}
    for worker, lease_id in (("gen-2", first.lease_id), ("gen-1", other.lease_id), ("gen-1", "0" * 32)):
        request = EvalResultRequest(worker_id=worker, lease_id=lease_id, summary=summary(2, 0.5))
        with pytest.raises(NotTaskHolder):
            coord.eval_result("eval-r1-v0-0", request)
    assert {key: redis_client.dump(key) for key in sorted(redis_client.keys("*"))} == before
    request = EvalResultRequest(worker_id="gen-1", lease_id=first.lease_id, summary=summary(2, 0.5))
    assert coord.eval_result("eval-r1-v0-0", request).chunks_left == 2


def test_restart_and_rebuild_never_evaluate_twice(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord = start_run(make(redis_client, bucket, clock))
    eval_all(coord, 0)
    coord.tick()
    submitted: set[str] = set()
    advance_version(coord, submitted)
    advance_version(coord, submitted)  # v2 due, pending
    coord.tick()
    # A restarted proxy on the same Redis goes on: nothing is sent again.
    again = make(redis_client, bucket, clock)
    again.tick()
    assert again.dispatcher.evals == [] and again.status().evals_pending == 1
    # An empty Redis: v0 has its record (passed over), v2 is evaluated again.
    redis_client.flushdb()
    rebuilt = make(redis_client, bucket, clock)
    rebuilt.tick()
    assert {m["version"] for m in rebuilt.dispatcher.evals} == {2}
    eval_all(rebuilt, 2, reward=0.25)
    rebuilt.tick()
    latest = rebuilt.status().eval_latest
    assert latest is not None and latest.version == 2 and latest.metrics["reward"] == pytest.approx(0.25)


def test_http_routes_and_metrics(redis_client: Redis, bucket: Bucket, clock: ManualClock) -> None:
    coord = start_run(make(redis_client, bucket, clock))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(coord, TOKEN, run_loop=False)) as http:
        for message in coord.dispatcher.evals:
            answer = http.post(f"/v1/evals/{message['task_id']}/lease", json={"worker_id": "gen-1"}, headers=auth)
            assert answer.status_code == 200, answer.text
            grant = answer.json()
            assert grant["version"] == 0 and grant["prompt_start"] == message["prompt_start"]
            renewed = http.post(f"/v1/leases/{grant['lease_id']}/renew", headers=auth)
            assert renewed.status_code == 200 and renewed.json()["version"] == 0
            body = {
                "worker_id": "gen-1",
                "lease_id": grant["lease_id"],
                "summary": summary(grant["prompt_count"], 1.0).model_dump(mode="json"),
            }
            assert http.post(f"/v1/evals/{message['task_id']}/result", json=body, headers=auth).status_code == 200
        again = http.post("/v1/evals/eval-r1-v0-0/result", json=body, headers=auth)
        assert again.status_code == 410 and again.json()["error"] == "cancelled"
        assert live_leased_versions(coord.store) == set()  # every eval lease released with its result
        coord.tick()
        scrape = http.get("/metrics").text
        assert "asyncgrpo_eval_version 0.0" in scrape
        assert 'asyncgrpo_eval_reward{reward="total"} 1.0' in scrape
        assert 'asyncgrpo_eval_reward{reward="repeat_digit"} 1.0' in scrape
        assert 'asyncgrpo_eval_pass_at_k{k="1"} 1.0' in scrape
        assert "asyncgrpo_evals_pending 0.0" in scrape
        assert "asyncgrpo_eval_tasks_done_total 3.0" in scrape
        assert http.get("/v1/status", headers=auth).json()["eval_latest"]["version"] == 0


# ---- run create: the held-out prompts ----


def test_run_create_freezes_held_out_prompts(tmp_path: Path) -> None:
    from asyncgrpo.run.config import ConfigError
    from asyncgrpo.run.creation import create_run, load_eval_prompts, load_run

    bucket = file_bucket(tmp_path)
    base = '[dataset]\nnum_prompts = 8\n[[rewards]]\nname = "exact_match"\n'
    path = tmp_path / "eval.toml"
    path.write_text(base + "[eval]\nevery_versions = 2\n[eval.dataset]\nnum_prompts = 6\n")
    create_run(path, "with-eval", bucket)
    _, prompts, manifest = load_run(bucket, "with-eval")
    held_out = load_eval_prompts(bucket, "with-eval", manifest)
    assert len(held_out) == manifest.num_eval_prompts == 6
    assert held_out != prompts[:6]  # another seed than the training prompts

    plain = tmp_path / "plain.toml"
    plain.write_text(base)
    create_run(plain, "no-eval", bucket)
    _, _, manifest = load_run(bucket, "no-eval")
    assert manifest.eval_prompts is None and load_eval_prompts(bucket, "no-eval", manifest) == []
    assert bucket.head(bucket_keys.eval_prompts_key("no-eval")) is None

    (tmp_path / "held_out.jsonl").write_text('{"prompt": "4="}\n')
    no_answers = tmp_path / "bad.toml"
    eval_table = '[eval]\nevery_versions = 1\n[eval.dataset]\npath = "held_out.jsonl"\nanswer_column = ""\n'
    no_answers.write_text(base + eval_table)
    with pytest.raises(ConfigError, match=r"eval\.rewards\.0\.name='exact_match'.*eval\.dataset\.answer_column"):
        create_run(no_answers, "bad-eval", bucket)
