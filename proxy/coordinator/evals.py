"""Evaluation during training (``[eval]``): which versions are due, their eval tasks, leases and records.

With ``eval.every_versions = K`` the versions 0, K, 2K, ... and the run's final version are each evaluated once
on the held-out prompts. ``tick()`` (called by the housekeeping round, only while a generate worker is alive):

- re-sends eval tasks past their deadline (``async.generate_task_timeout_s``) or whose holder's heartbeats
  stopped; after ``async.max_group_attempts`` sends the version's evaluation is given up (logged, counted);
- merges the chunk summaries of each version whose chunks are all in, writes ``runs/<run>/evals/vNNNNNNNN.json``
  and keeps it as the newest summary (``/v1/status``, ``/metrics``);
- moves a cursor over the published versions: each due one is split into tasks of at most
  ``eval.max_prompts_per_task`` prompts sent to the run's generate queue, where generate workers take them
  between generate tasks, so training never waits for an evaluation.

A version is protected from GC from the moment it is published until its record is written or its evaluation
given up: due versions past the cursor and pending ones are in ``protected_versions()``, which retention adds
to the leased ones; the worker also holds an ordinary lease on it while it samples. Nothing of an evaluation
reaches a rollout or a step.

Restarts: the state is in Redis (``evals``, ``evals_inflight``). After an empty Redis is rebuilt the cursor
starts at 0 again: a due version whose record exists is passed over (never evaluated twice), one whose
adapter was collected meanwhile is skipped (logged, counted), any other is evaluated again, the final one
included.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import suppress

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError, ObjectExists
from asyncgrpo.protocol.evals import (
    EvalChunkSummary,
    EvalLeaseGrant,
    EvalResultAnswer,
    EvalResultRequest,
    EvalTaskMessage,
    merge_chunks,
)
from asyncgrpo.protocol.records import EvalRecord
from asyncgrpo.protocol.schemas import EvalSummary
from asyncgrpo.run.config import RunConfig
from proxy.coordinator.dispatch import Dispatcher, DispatchError
from proxy.coordinator.redis_store import RedisStore

log = structlog.get_logger()


def due_versions(config: RunConfig, first: int, last: int) -> list[int]:
    """The versions from ``first`` to ``last`` (both included) that ``[eval]`` evaluates, ascending."""
    every = config.eval.every_versions
    last = min(last, config.final_version)
    first = max(first, 0)
    if every <= 0 or last < first:
        return []
    start = -(-first // every) * every
    versions = list(range(start, last + 1, every))
    if first <= config.final_version <= last and config.final_version % every:
        versions.append(config.final_version)
    return versions


def eval_task_id(run: str, version: int, chunk: int) -> str:
    """The id of an eval task: the same on every re-send, so a late copy is recognised (and refused)."""
    return f"eval-{run}-v{version}-{chunk}"


def prompt_chunks(num_prompts: int, per_task: int) -> list[tuple[int, int]]:
    """(start, count) of each task's slice of the eval prompts."""
    return [(start, min(per_task, num_prompts - start)) for start in range(0, num_prompts, per_task)]


class Evals:
    """The evals of one run; inert (no Redis read) when ``[eval]`` is off."""

    def __init__(self, store: RedisStore, config: RunConfig, bucket: Bucket, num_eval_prompts: int) -> None:
        self.store = store
        self.config = config
        self.bucket = bucket
        self.num_eval_prompts = num_eval_prompts
        self.enabled = config.eval.every_versions > 0 and num_eval_prompts > 0
        self._timeout_ms = int(config.async_.generate_task_timeout_s * 1000)

    # ---- the housekeeping round ----

    def tick(self, dispatcher: Dispatcher, alive_s: float, *, send: bool = True) -> list[str]:
        """Record finished versions; with ``send`` (a generate worker is alive) re-send lost tasks and send the
        tasks of newly due versions. Returns the task ids sent. A bucket that fails is logged and tried again
        next tick."""
        if not self.enabled:
            return []
        try:
            self._record_complete()
            if not send:
                return []
            return self._retry(dispatcher, alive_s) + self._schedule(dispatcher)
        except (BucketError, OSError) as error:
            log.warning("proxy.eval_tick_failed", error=str(error))
            return []

    def _schedule(self, dispatcher: Dispatcher) -> list[str]:
        store = self.store
        current = store.current_version()
        cursor = self._cursor()
        if current < 0 or cursor > current:
            return []
        sent: list[str] = []
        for version in due_versions(self.config, cursor, current):
            sent += self._schedule_version(dispatcher, version)
        store.scripts.schedule_eval(deadline_ms=0, version=current, cursor=current + 1, tasks=[])
        return sent

    def _schedule_version(self, dispatcher: Dispatcher, version: int) -> list[str]:
        run = self.store.run
        passed = {"deadline_ms": 0, "version": version, "cursor": version + 1, "tasks": []}
        if self.bucket.head(bucket_keys.eval_key(run, version)) is not None:
            self.store.scripts.schedule_eval(**passed)  # evaluated before a rebuild: never twice
            return []
        if self.bucket.head(bucket_keys.manifest_key(run, version)) is None:
            log.warning("proxy.eval_skipped", version=version, reason="version no longer in the bucket")
            self.store.count("eval_versions_skipped")
            self.store.scripts.schedule_eval(**passed)
            return []
        deadline = self.store.clock_ms() + self._timeout_ms
        chunks = prompt_chunks(self.num_eval_prompts, self.config.eval.max_prompts_per_task)
        messages = [
            EvalTaskMessage(
                run=run,
                task_id=eval_task_id(run, version, index),
                version=version,
                prompt_start=start,
                prompt_count=count,
                expires_at=deadline / 1000.0,
            )
            for index, (start, count) in enumerate(chunks)
        ]
        tasks = [f"{m.task_id}:{m.prompt_start}:{m.prompt_count}" for m in messages]
        reply = self.store.scripts.schedule_eval(deadline_ms=deadline, version=version, cursor=version + 1, tasks=tasks)
        if not reply["scheduled"]:
            return []
        log.info("proxy.eval_scheduled", version=version, tasks=len(messages))
        return self._send(dispatcher, messages)

    def _send(self, dispatcher: Dispatcher, messages: list[EvalTaskMessage]) -> list[str]:
        sent = []
        for message in messages:
            try:
                dispatcher.send_eval(message)
            except DispatchError as error:
                # Still in flight in Redis: sent again at its deadline.
                log.warning("proxy.eval_send_failed", task_id=message.task_id, error=str(error))
                continue
            sent.append(message.task_id)
        return sent

    def _retry(self, dispatcher: Dispatcher, alive_s: float) -> list[str]:
        store = self.store
        if not store.redis.zcard(store.keys.evals_inflight):
            return []
        now = store.clock_ms()
        deadline = now + self._timeout_ms
        reply = store.scripts.retry_evals(
            now_ms=now,
            alive_since_ms=now - int(alive_s * 1000),
            deadline_ms=deadline,
            max_attempts=self.config.async_.max_group_attempts,
        )
        for version in reply["failed_json"]:
            log.warning("proxy.eval_given_up", version=int(version), attempts=self.config.async_.max_group_attempts)
        messages = [
            EvalTaskMessage(
                run=store.run,
                task_id=item["task_id"],
                version=int(item["version"]),
                prompt_start=int(item["start"]),
                prompt_count=int(item["count"]),
                expires_at=deadline / 1000.0,
            )
            for item in reply["resend_json"]
        ]
        if messages:
            log.warning("proxy.eval_resent", task_ids=[m.task_id for m in messages])
        return self._send(dispatcher, messages)

    def _pending(self) -> dict[int, dict]:
        """Version -> ``{"left", "tasks"}`` of every version due and not yet recorded."""
        fields = [f for f in self.store.redis.hkeys(self.store.keys.evals) if f.startswith("v:")]
        if not fields:
            return {}
        values = self.store.redis.hmget(self.store.keys.evals, fields)
        return {int(f[2:]): json.loads(v) for f, v in zip(fields, values, strict=True) if v is not None}

    def _record_complete(self) -> None:
        for version, pending in sorted(self._pending().items()):
            if pending["left"] > 0:
                continue
            try:
                self._write_record(version, pending["tasks"])
            except BucketError as error:
                log.warning("proxy.eval_record_failed", version=version, error=str(error))  # next round again
                return

    def _write_record(self, version: int, task_ids: list[str]) -> None:
        store, cfg = self.store, self.config.eval
        raw = store.redis.hmget(store.keys.evals, [f"s:{task_id}" for task_id in task_ids])
        chunks = [EvalChunkSummary.model_validate_json(item) for item in raw if item is not None]
        metrics, examples, prompts = merge_chunks(chunks, cfg.examples)
        record = EvalRecord(
            run=store.run,
            version=version,
            evaluated_at=time.time(),
            prompts=prompts,
            samples_per_prompt=cfg.samples_per_prompt,
            temperature=cfg.temperature,
            metrics=metrics,
            examples=examples,
        )
        key = bucket_keys.eval_key(store.run, version)
        # ObjectExists: written by an earlier round that failed to close it; the first record stands.
        with suppress(ObjectExists):
            self.bucket.put(key, record.model_dump_json(indent=2).encode(), if_absent=True)
        summary = EvalSummary(version=version, metrics=metrics)
        store.scripts.close_eval(version=version, summary_json=summary.model_dump_json())
        log.info("proxy.eval_recorded", version=version, key=key, reward=metrics.get("reward"))

    # ---- requests ----

    def lease(self, worker_id: str, task_id: str, incarnation: str = "") -> EvalLeaseGrant:
        """Lease the task's version for ``worker_id``; raises EvalEnded if it is not in flight."""
        store = self.store
        now = store.clock_ms()
        lease_id = uuid.uuid4().hex
        ttl_s = self.config.async_.lease_ttl_s
        reply = store.scripts.grant_eval_lease(
            now_ms=now,
            ttl_ms=int(ttl_s * 1000),
            lease_id=lease_id,
            worker_id=worker_id,
            task_id=task_id,
            deadline_ms=now + self._timeout_ms,
            incarnation=incarnation,
        )
        version = reply["version"]
        return EvalLeaseGrant(
            lease_id=lease_id,
            version=version,
            adapter_prefix=bucket_keys.adapter_prefix(store.run, version),
            manifest_key=bucket_keys.manifest_key(store.run, version),
            manifest_sha256=reply["manifest_sha256"] or "",
            ttl_s=ttl_s,
            expires_at=reply["expires_ms"] / 1000.0,
            prompt_start=reply["prompt_start"],
            prompt_count=reply["prompt_count"],
        )

    def result(self, task_id: str, request: EvalResultRequest) -> EvalResultAnswer:
        """Keep a chunk's summary and release its lease; raises EvalEnded if the task is not in flight, and
        NotTaskHolder (nothing changed) if ``request.lease_id`` is not the sender's live lease of the task."""
        reply = self.store.scripts.finish_eval_chunk(
            task_id=task_id,
            lease_id=request.lease_id,
            summary_json=request.summary.model_dump_json(),
            worker_id=request.worker_id,
        )
        return EvalResultAnswer(version=reply["version"], chunks_left=reply["chunks_left"])

    def fail(self, task_id: str, worker_id: str) -> bool:
        """The worker holding ``task_id`` reports it failed for good: make it due now, so the next tick sends it
        again (counting an attempt, and giving the version up at the limit) instead of at its deadline. False if
        the task is not in flight or another worker holds it."""
        raw = self.store.redis.hget(self.store.keys.evals, f"t:{task_id}")
        if raw is None or json.loads(raw).get("worker") != worker_id:
            return False
        # XX: only while still in flight (a result or a give-up in between removed it).
        inflight = self.store.keys.evals_inflight
        self.store.redis.zadd(inflight, {task_id: self.store.clock_ms()}, xx=True)
        return self.store.redis.zscore(inflight, task_id) is not None

    # ---- views: retention, status, metrics ----

    def _cursor(self) -> int:
        return int(self.store.redis.hget(self.store.keys.evals, "cursor") or 0)

    def protected_versions(self) -> set[int]:
        """Versions GC must keep: pending evals, and due versions the cursor has not reached."""
        if not self.enabled:
            return set()
        waiting = due_versions(self.config, self._cursor(), self.store.current_version())
        return set(self._pending()) | set(waiting)

    def pending_count(self) -> int:
        """Versions due and not recorded yet (given-up and skipped ones are not pending)."""
        return len(self.protected_versions())

    def latest(self) -> EvalSummary | None:
        if not self.enabled:
            return None
        raw = self.store.redis.hget(self.store.keys.evals, "latest")
        return EvalSummary.model_validate_json(raw) if raw else None
