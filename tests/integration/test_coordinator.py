"""The coordinator against a real Redis (private redis-server) and a FileBucket, with a manual clock."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.layout import list_versions, write_version
from asyncgrpo.protocol.schemas import HeartbeatRequest, StaleRolloutError
from proxy.coordinator.rollouts import normalise_reason
from proxy.coordinator.scripts import (
    BadRollout,
    BadVersionNumber,
    CasLost,
    LeaseLostError,
    ManifestMismatch,
    ManifestMissing,
    NoVersionYet,
    PublishConflict,
    StepNotClaimed,
    StepNotFound,
    TaskCancelled,
    UnknownTask,
)
from proxy.coordinator.service import Coordinator
from tests.support.proxy_harness import (
    ManualClock,
    advance_version,
    file_bucket,
    lease_task,
    make_coordinator,
    publish_next,
    publish_request,
    small_config,
    submission,
    submit_pending,
    write_fake_version,
)


def started(coord: Coordinator) -> Coordinator:
    """Init step sent and version 0 published; generate tasks dispatched."""
    coord.tick()
    assert coord.dispatcher.optimize[-1] == {"run": "r1", "step": 0, "base_version": -1, "rollouts": []}
    assert publish_next(coord) == 0
    coord.tick()
    return coord


def task_by_id(coord: Coordinator, task_id: str) -> dict:
    return next(t for t in coord.dispatcher.generate if t["task_id"] == task_id)


# ---- init and dispatch ----


def test_init_step_then_generate_tasks_fill_the_buffer(coord: Coordinator) -> None:
    report = coord.tick()
    assert report.rebuilt == "fresh" and report.step_claimed == 0
    assert coord.dispatcher.generate == [], "no generate task before version 0 exists"
    with pytest.raises(NoVersionYet):
        coord.lease("gen-1", "t")
    publish_next(coord)
    coord.tick()
    cfg = coord.config.async_
    assert len(coord.dispatcher.generate) == cfg.queue_maxsize // cfg.groups_per_task
    status = coord.status()
    assert status.groups_inflight == cfg.queue_maxsize and status.tasks_inflight == 4
    assert coord.tick().tasks_sent == [], "buffer full: nothing more dispatched"


def test_run_stops_at_its_final_version(redis_client: Redis, tmp_path: Path) -> None:
    config = small_config().model_copy(
        update={"optimizer": small_config().optimizer.model_copy(update={"total_steps": 2})}
    )
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=config)
    started(coord)
    submitted: set[str] = set()
    assert advance_version(coord, submitted) == 1
    assert not coord.status().finished
    assert advance_version(coord, submitted) == 2
    status = coord.status()
    assert status.finished and status.final_version == 2
    sent_before = len(coord.dispatcher.generate)
    submit_pending(coord, submitted)
    for _ in range(3):
        report = coord.tick()
        assert report.step_claimed is None and report.tasks_sent == []
    assert len(coord.dispatcher.generate) == sent_before and coord.current_version() == 2


def test_no_step_is_claimed_from_the_final_version_even_past_the_ticks_own_check(
    redis_client: Redis, tmp_path: Path
) -> None:
    # The tick reads "not finished", a publish of the final version lands from a request thread, then the tick
    # claims: the claim itself must refuse (a clean-clone CI run trained step 9 of an 8-step run this way).
    config = small_config().model_copy(
        update={"optimizer": small_config().optimizer.model_copy(update={"total_steps": 2})}
    )
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=config)
    started(coord)
    submitted: set[str] = set()
    assert advance_version(coord, submitted) == 1
    assert advance_version(coord, submitted) == 2
    submit_pending(coord, submitted)
    submit_pending(coord, submitted)
    assert coord.status().groups_buffered >= config.async_.groups_per_step  # a full step's worth is waiting
    assert coord.steps.claim()[0] is None  # what the tick calls after its own check
    assert coord.status().step_inflight is None and coord.current_version() == 2


def test_prompt_order_is_a_seeded_permutation_per_epoch(redis_client: Redis, tmp_path: Path) -> None:
    config = small_config(seed=7, groups_per_task=2, groups_per_step=2, queue_maxsize=12, adaptive_inflight=False)
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=config, num_prompts=5)
    started(coord)
    sent = [g["prompt_index"] for t in coord.dispatcher.generate for g in t["groups"]]
    expected: list[int] = []
    for epoch in range(3):
        perm = list(range(5))
        random.Random(7 + epoch).shuffle(perm)
        expected += perm
    assert sent == expected[: len(sent)] and len(sent) == 12
    group_ids = [g["group_id"] for t in coord.dispatcher.generate for g in t["groups"]]
    assert len(set(group_ids)) == len(group_ids)


# ---- publish: the CAS ----


def test_concurrent_publishers_exactly_one_wins(coord: Coordinator) -> None:
    started(coord)
    submitted: set[str] = set()
    submit_pending(coord, submitted)
    coord.tick()
    assert coord.status().step_inflight == 1
    sha = write_fake_version(coord.bucket, coord.run, 1)
    barrier = threading.Barrier(8)
    outcomes: list[object] = []

    def publisher(index: int) -> None:
        barrier.wait()
        try:
            outcomes.append(coord.publish(publish_request(1, sha, worker_id=f"trainer-{index}")).current_version)
        except PublishConflict as error:
            outcomes.append(error)

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wins = [o for o in outcomes if o == 1]
    losses = [o for o in outcomes if isinstance(o, CasLost)]
    assert len(wins) == 1 and len(losses) == 7, outcomes
    assert coord.current_version() == 1
    assert coord.status().counters["conflicts"] == 7
    # The version never goes back, and nothing but base == current publishes.
    _, skipping_sha = write_version(coord.bucket, coord.run, 3, {"adapter_config.json": b"{}"}, {})
    with pytest.raises(BadVersionNumber):
        coord.publish(publish_request(3, skipping_sha).model_copy(update={"base_version": 1}))
    with pytest.raises(ManifestMismatch, match="base_version"):
        coord.publish(publish_request(1, sha).model_copy(update={"base_version": 1}))
    with pytest.raises(CasLost):
        coord.publish(publish_request(1, sha, worker_id="zombie"))
    assert coord.current_version() == 1


def test_publish_retry_by_the_winner_is_not_a_conflict(coord: Coordinator) -> None:
    started(coord)
    request = publish_request(0, write_fake_version(coord.bucket, coord.run, 0))
    assert coord.publish(request).current_version == 0  # same worker, same manifest: a retried request


def test_publish_checks_the_manifest(coord: Coordinator) -> None:
    started(coord)
    submit_pending(coord, set())
    coord.tick()
    with pytest.raises(ManifestMissing, match=r"no MANIFEST\.json"):
        coord.publish(publish_request(1, "a" * 64))
    sha = write_fake_version(coord.bucket, coord.run, 1)
    with pytest.raises(ManifestMismatch, match="sha256"):
        coord.publish(publish_request(1, "b" * 64))
    assert coord.current_version() == 0
    assert coord.publish(publish_request(1, sha)).current_version == 1


def test_publish_without_a_claimed_step_is_refused(coord: Coordinator) -> None:
    started(coord)
    sha = write_fake_version(coord.bucket, coord.run, 1)
    with pytest.raises(StepNotClaimed):
        coord.publish(publish_request(1, sha))
    assert coord.current_version() == 0


# ---- submit: staleness, duplicates, bad input ----


def _leased_two_versions_ago(coord: Coordinator) -> dict:
    """A generate task leased on v0, not submitted while the run went on to v2."""
    started(coord)
    late = coord.dispatcher.generate[0]
    lease_task(coord, late)  # on v0
    submitted = {late["task_id"]}
    advance_version(coord, submitted)
    advance_version(coord, submitted)
    assert coord.current_version() == 2
    return late


def test_stale_rollout_is_refused_and_its_prompts_dispatched_again(coord: Coordinator) -> None:
    late = _leased_two_versions_ago(coord)
    with pytest.raises(StaleRolloutError, match="rollout v0 is 2 versions behind v2"):
        coord.submit(submission(coord, late, version=0))
    for group in late["groups"]:
        assert coord.group_record(group["group_id"])["state"] == "stale"
    counters = coord.status().counters
    assert counters["groups_stale"] == 2 and counters["rollouts_stale"] == 1
    before = len(coord.dispatcher.generate)
    coord.tick()
    redispatched = coord.dispatcher.generate[before]
    assert [g["prompt_index"] for g in redispatched["groups"]] == [g["prompt_index"] for g in late["groups"]]
    assert {g["group_id"] for g in redispatched["groups"]}.isdisjoint({g["group_id"] for g in late["groups"]})
    # Submitting the stale task again changes nothing.
    with pytest.raises(StaleRolloutError):
        coord.submit(submission(coord, late, version=0))
    assert coord.status().counters["groups_stale"] == 2


@pytest.mark.parametrize("stale_tokens", ["drop", "mask"])
def test_a_rollout_that_followed_newer_versions_is_as_stale_as_its_oldest_token_unless_masked(
    redis_client: Redis, tmp_path: Path, stale_tokens: str
) -> None:
    """Leased at v0, its sequences followed v1 and v2: at v2 (max_staleness 1) its oldest tokens are out of the
    window. Dropped and requeued by default; with async.stale_tokens = "mask" admitted, buffered at its newest
    token's version (what the claim checks), the trainer masking the older tokens."""
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=small_config(stale_tokens=stale_tokens))
    late = _leased_two_versions_ago(coord)
    followed = submission(coord, late, version=0).model_copy(update={"newest_version": 2})
    if stale_tokens == "mask":  # unmasked, the newest token decides nothing
        with pytest.raises(BadRollout, match="v3 is newer than the current version v2"):
            coord.submit(followed.model_copy(update={"newest_version": 3}))
    with pytest.raises(BadRollout, match="newest_version v0 is older than its version v1"):
        coord.submit(followed.model_copy(update={"version": 1, "newest_version": 0}))
    task_state = coord.redis.hget(coord.keys.task(late["task_id"]), "state")
    assert task_state == "inflight", "a refused submission changes nothing"
    if stale_tokens == "drop":
        with pytest.raises(StaleRolloutError, match="rollout v0 is 2 versions behind v2"):
            coord.submit(followed)
        assert coord.status().counters["rollouts_stale"] == 1
        return
    assert coord.submit(followed).status == "admitted"
    assert coord.redis.hget(coord.keys.rollout(late["task_id"]), "version") == "2"
    assert {coord.group_record(g["group_id"])["version"] for g in late["groups"]} == {"2"}
    assert coord.status().counters.get("rollouts_stale", 0) == 0
    # The ref the trainer gets still names the leased version (the tokens' own versions are in the rollout).
    assert '"version":0' in coord.redis.hget(coord.keys.rollout(late["task_id"]), "ref")


@pytest.mark.parametrize("stale_tokens", ["drop", "mask"])
def test_a_rollout_that_continues_older_partial_sequences_is_as_stale_as_its_oldest_token(
    redis_client: Redis, tmp_path: Path, stale_tokens: str
) -> None:
    """Handed back after sampling on v0, the task is leased again on v2 by another worker, which continues the
    saved sequences (async.partial_rollouts): its tokens go back to v0, older than the window of v2 at
    max_staleness 1. Judged by that oldest token by default; with "mask" by its newest, the leased version."""
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=small_config(stale_tokens=stale_tokens))
    late = _leased_two_versions_ago(coord)
    lease_task(coord, late, worker_id="gen-2")  # on v2
    continued = submission(coord, late, version=2, worker_id="gen-2").model_copy(update={"oldest_version": 0})
    with pytest.raises(BadRollout, match="oldest_version v2 is not older than its version v2"):
        coord.submit(continued.model_copy(update={"oldest_version": 2}))
    if stale_tokens == "drop":
        with pytest.raises(StaleRolloutError, match="rollout v0 is 2 versions behind v2"):
            coord.submit(continued)
        assert coord.status().counters["rollouts_stale"] == 1
        return
    assert coord.submit(continued).status == "admitted"
    assert coord.redis.hget(coord.keys.rollout(late["task_id"]), "version") == "2"


def test_a_rollout_whose_continued_tokens_are_inside_the_window_is_buffered_at_their_version(
    coord: Coordinator,
) -> None:
    late = _leased_two_versions_ago(coord)
    lease_task(coord, late, worker_id="gen-2")  # on v2; its saved tokens are v1's, inside the window
    continued = submission(coord, late, version=2, worker_id="gen-2").model_copy(update={"oldest_version": 1})
    assert coord.submit(continued).status == "admitted"
    assert coord.redis.hget(coord.keys.rollout(late["task_id"]), "version") == "1"  # what the claim checks
    assert {coord.group_record(g["group_id"])["version"] for g in late["groups"]} == {"1"}


def test_fresh_rollout_admitted_once_when_submitted_twice(coord: Coordinator) -> None:
    started(coord)
    task = coord.dispatcher.generate[0]
    assert coord.submit(submission(coord, task, 0)).status == "admitted"
    assert coord.submit(submission(coord, task, 0)).status == "duplicate"
    status = coord.status()
    assert status.counters["rollouts_admitted"] == 1
    assert status.counters["rollouts_duplicate"] == 1
    assert status.groups_buffered == 2
    assert coord.redis.lrange(coord.keys.buffer, 0, -1) == [task["task_id"]]


def test_rejected_groups_are_counted_with_their_reason(coord: Coordinator) -> None:
    started(coord)
    task = coord.dispatcher.generate[0]
    bad = task["groups"][1]["group_id"]
    coord.submit(submission(coord, task, 0, rejected={bad: "Prompt too long (300 > 256 tokens)"}))
    record = coord.group_record(bad)
    assert record["state"] == "rejected" and record["reason"] == "prompt_too_long_300_256_tokens"
    status = coord.status()
    assert status.rejected_by_reason == {"prompt_too_long_300_256_tokens": 1}
    assert status.groups_buffered == 1 and status.counters["groups_rejected"] == 1


def test_groups_left_out_of_a_submission_are_rejected_not_lost(coord: Coordinator) -> None:
    started(coord)
    task = coord.dispatcher.generate[0]
    sub = submission(coord, task, 0).model_copy(update={"group_ids": [task["groups"][0]["group_id"]]})
    coord.submit(sub)
    assert coord.group_record(task["groups"][1]["group_id"])["reason"] == "missing_from_rollout"


def test_bad_submissions_change_nothing(coord: Coordinator) -> None:
    started(coord)
    task, other = coord.dispatcher.generate[0], coord.dispatcher.generate[1]
    lease_task(coord, task)
    before = coord.status()
    foreign = submission(coord, task, 0).model_copy(update={"group_ids": [other["groups"][0]["group_id"]]})
    with pytest.raises(BadRollout, match="not part of task"):
        coord.submit(foreign)
    twice = submission(coord, task, 0, rejected={task["groups"][0]["group_id"]: "x"})
    twice = twice.model_copy(update={"group_ids": [g["group_id"] for g in task["groups"]]})
    with pytest.raises(BadRollout, match="listed twice"):
        coord.submit(twice)
    with pytest.raises(BadRollout, match="newer than the current version"):
        coord.submit(submission(coord, task, 5, lease=False))
    with pytest.raises(BadRollout, match="must be"):
        coord.submit(submission(coord, task, 0).model_copy(update={"key": "runs/r1/rollouts/else.safetensors"}))
    with pytest.raises(UnknownTask):
        coord.submit(submission(coord, {**task, "task_id": "gen-r1-0-99999999"}, 0))
    after = coord.status()
    assert after.counters == before.counters and after.groups_inflight == before.groups_inflight
    assert coord.group_record(task["groups"][0]["group_id"])["state"] == "inflight"


def test_lost_generate_task_is_cancelled_and_requeued(coord: Coordinator, clock: ManualClock) -> None:
    started(coord)
    task = coord.dispatcher.generate[0]
    clock.advance(coord.config.async_.generate_task_timeout_s + 1)
    report = coord.tick()
    assert report.tasks_cancelled == 4
    assert coord.group_record(task["groups"][0]["group_id"])["state"] == "cancelled"
    with pytest.raises(TaskCancelled):
        coord.submit(submission(coord, task, 0))
    # All eight prompts came back first, in order, in new tasks.
    resent = [g["prompt_index"] for t in coord.dispatcher.generate[4:] for g in t["groups"]]
    original = [g["prompt_index"] for t in coord.dispatcher.generate[:4] for g in t["groups"]]
    assert resent == original


def test_send_failure_requeues_at_once(coord: Coordinator) -> None:
    coord.tick()
    publish_next(coord)
    coord.dispatcher.fail = True
    coord.tick()
    status = coord.status()
    assert status.tasks_inflight == 0 and status.groups_requeued == 8
    coord.dispatcher.fail = False
    coord.tick()
    assert len(coord.dispatcher.generate) == 4 and coord.status().groups_requeued == 0


# ---- claim ----


def test_claim_takes_oldest_and_drops_too_stale(redis_client: Redis, tmp_path: Path) -> None:
    config = small_config(max_staleness=0, groups_per_task=2, groups_per_step=4, queue_maxsize=8)
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=config)
    started(coord)
    x, y, a = coord.dispatcher.generate[:3]
    for task in (x, y, a):
        coord.submit(submission(coord, task, 0))
    report = coord.tick()
    assert report.step_claimed == 1
    batch = coord.get_step(1)
    assert [r.task_id for r in batch.rollouts] == [x["task_id"], y["task_id"]]
    assert batch == coord.get_step(1), "the same batch on every call"
    assert coord.metrics.sample_staleness._sum.get() == 0
    publish_next(coord)
    assert coord.tick().stale_dropped == 2  # a (v0) is now 1 behind v1 with max_staleness=0: dropped, requeued
    assert coord.group_record(a["groups"][0]["group_id"])["state"] == "stale"
    assert coord.status().counters["groups_stale"] == 2
    for group in x["groups"] + y["groups"]:
        assert coord.group_record(group["group_id"])["state"] == "trained"
    with pytest.raises(StepNotFound):
        coord.get_step(7)


def test_the_buffer_is_scanned_for_staleness_once_per_version(redis_client: Redis, tmp_path: Path) -> None:
    """Rounds that cannot claim (too few groups) do not re-read every buffered rollout: staleness changes only
    with the version. The scan after a publish still drops what the publish made too stale."""
    config = small_config(max_staleness=0, groups_per_task=2, groups_per_step=4, queue_maxsize=8)
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=config)
    started(coord)
    first, second = coord.dispatcher.generate[:2]
    coord.submit(submission(coord, first, 0))
    coord.tick()
    assert coord.redis.hget(coord.keys.state, "stale_scan") == "0:0"
    # Made stale behind the proxy's back: a scan would drop it; rounds at this version do not scan again.
    coord.redis.hset(coord.keys.rollout(first["task_id"]), "version", -5)
    for _ in range(3):
        assert coord.tick().stale_dropped == 0
    coord.redis.hset(coord.keys.rollout(first["task_id"]), "version", 0)
    coord.submit(submission(coord, second, 0))
    assert coord.tick().step_claimed == 1
    publish_next(coord)
    coord.tick()
    assert coord.redis.hget(coord.keys.state, "stale_scan") == "1:0"


def test_unpublished_step_is_resent_with_the_same_batch(coord: Coordinator, clock: ManualClock) -> None:
    started(coord)
    submit_pending(coord, set())
    coord.tick()
    first = coord.dispatcher.optimize[-1]
    assert first["step"] == 1
    coord.tick()
    assert len(coord.dispatcher.optimize) == 2, "not re-sent before the timeout"
    clock.advance(coord.config.async_.optimize_task_timeout_s + 1)
    assert coord.tick().step_sent == 1
    assert coord.dispatcher.optimize[-1] == first
    assert coord.status().counters["optimize_resent"] == 1


# ---- leases and GC ----


def test_lease_renew_release_expire(coord: Coordinator, clock: ManualClock) -> None:
    started(coord)
    grant = coord.lease("gen-1", "task-1")
    assert grant.version == 0 and grant.manifest_key == bucket_keys.manifest_key("r1", 0)
    ttl_ms = coord.redis.pttl(coord.keys.lease(grant.lease_id))
    assert 0 < ttl_ms <= 60_000, "Redis enforces the TTL as a backstop"
    clock.advance(50)
    assert coord.renew(grant.lease_id).expires_at == clock.now_ms / 1000 + 60
    clock.advance(59)
    coord.renew(grant.lease_id)
    assert coord.release(grant.lease_id) is True
    assert coord.release(grant.lease_id) is False
    with pytest.raises(LeaseLostError):
        coord.renew(grant.lease_id)
    other = coord.lease("gen-2", "task-2")
    clock.advance(61)
    assert coord.tick().leases_expired == 1
    with pytest.raises(LeaseLostError, match="renew more often"):
        coord.renew(other.lease_id)
    assert coord.status().counters["leases_expired"] == 1


def test_a_submission_releases_the_lease_it_names(coord: Coordinator) -> None:
    """One round trip less per task: the submission carries the lease, admitted or refused."""
    started(coord)
    fresh, refused = coord.dispatcher.generate[0], coord.dispatcher.generate[1]
    kept = coord.lease("gen-3", "task-without-submission")
    grant = coord.lease("gen-1", fresh["task_id"])
    coord.submit(submission(coord, fresh, 0).model_copy(update={"lease_id": grant.lease_id}))
    assert {lease.lease_id for lease in coord.status().leases} == {kept.lease_id}
    other = coord.lease("gen-2", refused["task_id"])
    with pytest.raises(BadRollout):
        bad_key = {"key": "elsewhere", "lease_id": other.lease_id}
        coord.submit(submission(coord, refused, 0, worker_id="gen-2").model_copy(update=bad_key))
    assert {lease.lease_id for lease in coord.status().leases} == {kept.lease_id}


def test_leased_version_survives_gc_until_the_lease_ends(coord: Coordinator, clock: ManualClock) -> None:
    started(coord)
    held = coord.lease("slow-gen", "t-slow")  # on v0
    other = None
    submitted: set[str] = set()
    max_staleness = coord.config.async_.max_staleness
    for _ in range(5):
        advance_version(coord, submitted)
        coord.tick()
        current = coord.current_version()
        present = set(list_versions(coord.bucket, coord.run))
        window = set(range(max(0, current - max_staleness - 1), current + 1))
        assert window <= present, f"versions in the window must stay: {window - present} gone"
        assert 0 in present, "a leased version is never collected"
        if current == 2:
            other = coord.lease("gen-x", "t-x")  # on v2
    assert coord.current_version() == 5
    assert set(list_versions(coord.bucket, coord.run)) == {0, 2, 3, 4, 5}
    coord.release(other.lease_id)
    coord.tick()
    assert set(list_versions(coord.bucket, coord.run)) == {0, 3, 4, 5}
    clock.advance(61)
    coord.tick()
    assert set(list_versions(coord.bucket, coord.run)) == {3, 4, 5}
    with pytest.raises(LeaseLostError):
        coord.renew(held.lease_id)


def test_gc_keeps_every_keep_every_th_version(redis_client: Redis, tmp_path: Path) -> None:
    coord = make_coordinator(redis_client, file_bucket(tmp_path), config=small_config(keep_every=2, max_staleness=0))
    started(coord)
    submitted: set[str] = set()
    for _ in range(5):
        advance_version(coord, submitted)
    coord.tick()
    assert set(list_versions(coord.bucket, coord.run)) == {0, 2, 4, 5}


# ---- workers ----


def test_workers_alive_from_heartbeats(coord: Coordinator, clock: ManualClock) -> None:
    started(coord)
    report = HeartbeatRequest(worker_id="gpu-1", role="generate", hostname="h", pid=1, state="idle")
    coord.heartbeat(report)
    coord.heartbeat(report.model_copy(update={"worker_id": "trainer", "role": "optimize"}))
    assert coord.status().workers_alive_by_role == {"generate": 1, "optimize": 1}
    clock.advance(31)
    coord.heartbeat(report)
    workers = {w.worker_id: w for w in coord.workers()}
    assert workers["gpu-1"].alive and not workers["trainer"].alive
    assert coord.status().workers_alive_by_role == {"generate": 1}


def test_reason_labels_are_bounded() -> None:
    assert normalise_reason("  Bad PROMPT!! ") == "bad_prompt"
    assert normalise_reason("???") == "unspecified"
    assert len(normalise_reason("x" * 500)) == 40
