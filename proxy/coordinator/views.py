"""The views of one run's state: ``/v1/run`` (``run_info``), ``/v1/status`` (``status``), ``/metrics``
(``gauges``) and a group's record. Reads only; ``Coordinator`` serves them."""

from __future__ import annotations

from typing import Any

from redis.client import Pipeline

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.protocol.schemas import LeaseRecord, RunInfo, StatusResponse
from asyncgrpo.run.config import RunConfig
from proxy.coordinator.metrics import StateGauges
from proxy.coordinator.redis_store import RedisStore
from proxy.coordinator.workers import Workers


def run_info(store: RedisStore, *, num_prompts: int, config_sha256: str, prompts_sha256: str) -> RunInfo:
    """What ``/v1/run`` tells a worker: the run's inputs with their digests, so it can verify what it reads."""
    return RunInfo(
        run=store.run,
        config_key=bucket_keys.config_key(store.run),
        config_sha256=config_sha256,
        prompts_key=bucket_keys.prompts_key(store.run),
        prompts_sha256=prompts_sha256,
        num_prompts=num_prompts,
        current_version=store.current_version(),
    )


def _live_leases(store: RedisStore, leases: list[tuple[str, float]]) -> list[LeaseRecord]:
    pipe = store.redis.pipeline(transaction=False)
    for lease_id, _ in leases:
        pipe.hgetall(store.keys.lease(lease_id))
    return [
        LeaseRecord(
            lease_id=lease_id,
            version=int(rec["version"]),
            worker_id=rec["worker_id"],
            task_id=rec["task_id"],
            expires_at=expires / 1000.0,
        )
        for (lease_id, expires), rec in zip(leases, pipe.execute(), strict=True)
        if rec
    ]


def _queue_common_reads(store: RedisStore, pipe: Pipeline) -> None:
    """The reads ``status`` and ``gauges`` share, in this order (see ``_common_fields``)."""
    keys = store.keys
    pipe.hgetall(keys.state)
    pipe.hgetall(keys.counters)
    pipe.hgetall(keys.rejected_reasons)
    pipe.llen(keys.requeue)
    pipe.zcard(keys.tasks_inflight)


def _common_fields(config: RunConfig, replies: list[Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """The run's state hash, and the fields ``StatusResponse`` and ``StateGauges`` both carry."""
    state, counters, reasons, requeued, tasks = replies
    step_inflight = int(state.get("step_inflight", -1))
    return state, {
        "current_version": int(state.get("current_version", -1)),
        "final_version": config.final_version,
        "step_inflight": step_inflight if step_inflight >= 0 else None,
        "epoch": int(state.get("epoch", 0)),
        "groups_buffered": int(state.get("groups_buffered", 0)),
        "groups_inflight": int(state.get("groups_inflight", 0)),
        "groups_requeued": requeued,
        "tasks_inflight": tasks,
        "counters": {k: int(v) for k, v in counters.items()},
        "rejected_by_reason": {k: int(v) for k, v in reasons.items()},
        "halted": state.get("halted") or None,
    }


def status(store: RedisStore, config: RunConfig, workers: Workers) -> StatusResponse:
    """The run's state and counters, read in one transaction (leases and workers just after)."""
    pipe = store.redis.pipeline(transaction=True)
    _queue_common_reads(store, pipe)
    pipe.zrangebyscore(store.keys.leases, f"({store.clock_ms()}", "+inf", withscores=True)
    *common, leases = pipe.execute()
    state, fields = _common_fields(config, common)
    alive: dict[str, int] = {}
    for worker in workers.list():
        if worker.alive:
            alive[worker.role] = alive.get(worker.role, 0) + 1
    return StatusResponse(
        run=store.run,
        finished=fields["current_version"] >= config.final_version,
        epoch_pos=int(state.get("epoch_pos", 0)),
        leases=_live_leases(store, leases),
        workers_alive_by_role=alive,
        **fields,
    )


def gauges(store: RedisStore, config: RunConfig, alive_s: float) -> StateGauges:
    """What ``/metrics`` exports, in one transaction of counts (ZCOUNT, LLEN, ZCARD): no per-lease or
    per-worker read, unlike ``status``, so a scrape stays cheap however many workers there are."""
    keys = store.keys
    now = store.clock_ms()
    alive_since = now - int(alive_s * 1000)
    pipe = store.redis.pipeline(transaction=True)
    _queue_common_reads(store, pipe)
    pipe.zcount(keys.leases, f"({now}", "+inf")
    pipe.zcount(keys.workers_generate, alive_since, "+inf")
    pipe.zcount(keys.workers_optimize, alive_since, "+inf")
    *common, leases, generate, optimize = pipe.execute()
    _, fields = _common_fields(config, common)
    alive = {role: count for role, count in (("generate", generate), ("optimize", optimize)) if count}
    return StateGauges(leases_active=leases, workers_alive_by_role=alive, **fields)


def group_record(store: RedisStore, group_id: str) -> dict[str, str]:
    """A group's Redis record as it stands (empty once expired)."""
    return store.redis.hgetall(store.keys.group(group_id))
