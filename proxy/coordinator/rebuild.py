"""Rebuild of an empty Redis from the bucket, when Redis holds nothing for the run (invariant 6), from the
snapshot with its log applied (``proxy.coordinator.snapshot``, ``proxy.coordinator.snapshot_log``) or the versions
alone:

- no snapshot and no version in the bucket: a fresh run (current = -1, the init step will be sent);
- no snapshot but versions: start at the latest complete version (the prompt order restarts);
- a snapshot: restore it; if the bucket holds complete, contiguous versions above the snapshot's current one whose
  batches the snapshot accounts for (the claimed step's manifest must name that very batch), adopt them, newest as
  current, and mark their groups trained; otherwise keep the step claimed and send it again. A rebuild never goes
  back behind a version it can account for. Generate tasks that were in flight are cancelled and their prompts
  requeued (their broker messages may be gone with Redis); leases that have not expired are restored. Task ids
  carry an incarnation number bumped by every rebuild, so a task handed out before the crash never shares its id
  with one handed out after.

Rollout retention survives a rebuild: the snapshot carries the ``rollout_retention`` queue, and a rebuild
(from a snapshot or from the versions alone) also lists ``runs/<run>/rollouts/`` and queues every object
that is neither in the restored buffer nor in the restored step in flight, at the restored current version
(their tasks are finished, cancelled by the rebuild, or unknown to it: none of them can be trained any more).
So a flushed Redis leaks no rollout object, except one a worker writes after the rebuild for a task the
rebuilt proxy does not know (its submission is refused). A brand-new run lists nothing.

Tracker progress survives a rebuild too: the snapshot's ``tracking`` (per tracker the last step sent and the
versions whose eval was sent) becomes the ``tracking`` hash again, so the forwarder sends nothing twice that
the snapshot knew was sent. A snapshot written before the field existed restores none (every record is sent
again, as before); without a snapshot there is no progress to restore.

Which versions a rebuild adopts (``adopt_newer_versions``): never go back behind the latest published version,
never a foreign batch.

A snapshot can lag the bucket: a trainer uploads version N+1 and Redis dies before the publish reaches it,
or the last snapshot writes failed. The rebuild then walks the complete, contiguous manifests above the
snapshot's current version, oldest first, and adopts each one whose batch it can account for:

- the step the snapshot recorded as claimed: the manifest must name that step, its base version, and
  (``rollouts`` in its metadata) exactly the claimed task ids; a manifest written before the metadata had
  ``rollouts`` is matched on step and base alone;
- any later version: a step claimed after the snapshot was written, so its ``rollouts`` must all be admitted
  rollouts of the snapshot's buffer; they count as trained into that version.

The first manifest that fails these (another batch, a gap, a base that is not the version before) stops the
walk: it is logged (``proxy.rebuild_version_not_adopted``) and counted (``versions_not_adopted``), and the
claimed step, if any, is sent again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectNotFound
from asyncgrpo.bucket.layout import latest_complete_version, read_manifest
from asyncgrpo.run.config import RunConfig
from proxy.coordinator.redis_store import RedisStore, tracking_eval_field, tracking_step_field
from proxy.coordinator.scripts import StateExists
from proxy.coordinator.snapshot import load_stored_state


@dataclass(frozen=True)
class Claimed:
    """The step the snapshot recorded as claimed (in flight)."""

    step: int
    base: int
    task_ids: list[str]


@dataclass
class Adoption:
    """What the walk decided: the new current version, the manifests adopted, and where each buffered task
    went (trained into which version)."""

    current: int
    versions: dict[int, str] = field(default_factory=dict)
    claimed_adopted: bool = False
    trained_from_buffer: dict[str, int] = field(default_factory=dict)
    not_adopted: int = 0


def _newer_manifests(bucket: Bucket, run: str, current: int, latest: int | None) -> Iterator[tuple[int, dict, str]]:
    """Manifests of current+1, current+2, ... up to the first missing one (a gap ends the contiguous run)."""
    if latest is None:
        return
    for version in range(current + 1, latest + 1):
        try:
            manifest, sha = read_manifest(bucket, run, version)
        except ObjectNotFound:
            return
        yield version, manifest.metadata, sha


def _refusal(meta: dict[str, Any], version: int, current: int, claimed: Claimed | None, buffered: set[str]) -> str:
    """Why version ``version`` cannot be adopted on top of ``current`` ('' if it can)."""
    if meta.get("step") != version or meta.get("base_version") != current:
        return f"it names step {meta.get('step')} on base {meta.get('base_version')}, not step {version} on {current}"
    rollouts = meta.get("rollouts")
    if claimed is not None:
        if claimed.step != version or claimed.base != current:
            return f"the snapshot claimed step {claimed.step} on base {claimed.base} for it"
        if rollouts is not None and sorted(rollouts) != sorted(claimed.task_ids):
            return f"its batch {sorted(rollouts)} is not the claimed batch {sorted(claimed.task_ids)}"
        return ""
    if not isinstance(rollouts, list):
        return "its manifest names no rollouts, so its batch cannot be matched with the snapshot's buffer"
    unknown = sorted(set(rollouts) - buffered)
    if unknown:
        return f"its batch holds rollouts the snapshot's buffer does not: {unknown[:5]}"
    return ""


def adopt_newer_versions(
    bucket: Bucket, run: str, current: int, latest: int | None, claimed: Claimed | None, buffered: set[str]
) -> Adoption:
    """Walk the manifests above ``current`` (see the module doc); ``buffered``: task ids of the snapshot's
    buffer."""
    result = Adoption(current=current)
    remaining = set(buffered)
    for version, meta, sha in _newer_manifests(bucket, run, current, latest):
        pending = None if result.claimed_adopted else claimed
        reason = _refusal(meta, version, result.current, pending, remaining)
        if reason:
            result.not_adopted += 1
            log.error(
                "proxy.rebuild_version_not_adopted",
                run=run,
                version=version,
                current=result.current,
                reason=reason,
                hint="the bucket holds a version this run's snapshot does not explain; inspect it before going on",
            )
            break
        result.versions[version] = sha
        if pending is not None:
            result.claimed_adopted = True
        else:
            for tid in meta["rollouts"]:
                result.trained_from_buffer[tid] = version
                remaining.discard(tid)
        result.current = version
        log.warning("proxy.rebuild_adopted_version", run=run, version=version, base_version=version - 1)
    return result


log = structlog.get_logger()

_MAX_ARGS_PER_OP = 1000


@dataclass(frozen=True)
class _Sources:
    """What a rebuild reads: the store it writes into, the bucket and the run's config."""

    store: RedisStore
    bucket: Bucket
    config: RunConfig


class _Ops:
    """Redis writes for the restore script, every value a string."""

    def __init__(self, ttl_s: int) -> None:
        self.ops: list[list[str]] = []
        self.ttl_s = str(ttl_s)

    def hset(self, key: str, mapping: dict[str, Any], *, retire: bool = False) -> None:
        flat = [str(part) for item in mapping.items() for part in item]
        for start in range(0, len(flat), _MAX_ARGS_PER_OP):
            self.ops.append(["HSET", key, *flat[start : start + _MAX_ARGS_PER_OP]])
        if retire:
            self.ops.append(["EXPIRE", key, self.ttl_s])

    def rpush(self, key: str, values: list[Any]) -> None:
        for start in range(0, len(values), _MAX_ARGS_PER_OP):
            self.ops.append(["RPUSH", key, *(str(v) for v in values[start : start + _MAX_ARGS_PER_OP])])

    def zadd(self, key: str, scores: dict[str, int]) -> None:
        flat = [str(part) for member, score in scores.items() for part in (score, member)]
        for start in range(0, len(flat), _MAX_ARGS_PER_OP):
            self.ops.append(["ZADD", key, *flat[start : start + _MAX_ARGS_PER_OP]])


def _rollout_retention(src: _Sources, current: int, known: dict[str, int], needed: set[str]) -> dict[str, int]:
    """The retention queue of a rebuilt run: every rollout object in the bucket but the ``needed`` ones.

    ``known`` (the snapshot's queue) keeps its versions; any other object is queued at ``current``.
    Nothing is queued when the run keeps every rollout (``rollout_retention_versions = -1``).
    """
    if src.config.async_.rollout_retention_versions < 0:
        return {}
    prefix = bucket_keys.rollouts_prefix(src.store.run)
    queue: dict[str, int] = {}
    for key in src.bucket.list(prefix):
        task_id = key.removeprefix(prefix).removesuffix(".safetensors")
        # Only objects named exactly as the proxy names rollouts; anything else in the folder is left alone.
        if "/" in task_id or task_id in needed or not _is_rollout_key(src.store.run, task_id, key):
            continue
        queue[task_id] = min(known.get(task_id, current), current)
    return queue


def _is_rollout_key(run: str, task_id: str, key: str) -> bool:
    try:
        return bucket_keys.rollout_key(run, task_id) == key
    except ValueError:
        return False


def _fresh_ops(src: _Sources, latest: int | None, now: int) -> tuple[_Ops, str]:
    ops = _Ops(src.store.record_ttl_s)
    state: dict[str, Any] = {
        "current_version": -1 if latest is None else latest,
        "step_inflight": -1,
        "epoch": 0,
        "epoch_pos": 0,
        "task_seq": 0,
        "groups_inflight": 0,
        "groups_buffered": 0,
        # Without a snapshot, tasks from before may be out there: never reuse their ids.
        "incarnation": 0 if latest is None else now,
    }
    if latest is not None:
        _, sha = read_manifest(src.bucket, src.store.run, latest)
        ops.hset(src.store.keys.versions, {str(latest): sha})
        # No buffer and no step survive without a snapshot: every rollout in the bucket is finished.
        ops.zadd(src.store.keys.rollout_retention, _rollout_retention(src, latest, {}, set()))
    ops.hset(src.store.keys.state, state)
    return ops, "fresh" if latest is None else "rebuilt_from_versions"


def _rebuild_ops(src: _Sources, document: dict[str, Any], latest: int | None, now: int) -> _Ops:
    keys = src.store.keys
    ops = _Ops(src.store.record_ttl_s)
    state = dict(document["state"])
    counters = {name: int(value) for name, value in document["counters"].items()}
    versions = dict(document["versions"])
    requeue = list(document["requeue"])

    def count(name: str, amount: int = 1) -> None:
        counters[name] = counters.get(name, 0) + amount

    # Generate tasks in flight: their messages may have vanished with Redis; cancel and requeue.
    for item in document["inflight_tasks"]:
        ops.hset(keys.task(item["task_id"]), {**item["task"], "state": "cancelled", "ended_ms": now}, retire=True)
        for gid, group in item["groups"].items():
            if group.get("state") == "inflight":
                ops.hset(keys.group(gid), {**group, "state": "cancelled", "ended_ms": now}, retire=True)
                requeue.append(group["prompt_index"])
                count("groups_cancelled")
        count("tasks_cancelled")
    state["groups_inflight"] = 0

    current = int(state["current_version"])
    step_doc = document.get("step")
    claimed = None
    if step_doc:
        record = step_doc["record"]
        task_ids = [ref["task_id"] for ref in json.loads(record["rollouts"])]
        claimed = Claimed(int(record["step"]), int(record["base_version"]), task_ids)
    buffer_ids = {item["task_id"] for item in document["buffer"]}
    adoption = adopt_newer_versions(src.bucket, src.store.run, current, latest, claimed, buffer_ids)
    versions.update({str(version): sha for version, sha in adoption.versions.items()})
    state["current_version"] = current = adoption.current
    count("publish", len(adoption.versions))
    count("versions_not_adopted", adoption.not_adopted)
    known = {tid: int(version) for tid, version in document.get("rollout_retention", {}).items()}

    buffered = 0
    for item in document["buffer"]:
        tid, rollout = item["task_id"], item["rollout"]
        trained_into = adoption.trained_from_buffer.get(tid)
        if trained_into is not None:  # claimed and trained after the snapshot was written
            ops.hset(keys.rollout(tid), rollout, retire=True)
            ops.hset(keys.task(tid), {"state": "admitted", "version": rollout["version"]}, retire=True)
            for gid, group in item["groups"].items():
                ops.hset(keys.group(gid), {**group, "state": "trained", "ended_ms": now}, retire=True)
            count("groups_trained", len(item["groups"]))
            known[tid] = trained_into
            continue
        ops.hset(keys.rollout(tid), rollout)
        ops.rpush(keys.buffer, [tid])
        ops.hset(keys.task(tid), {"state": "admitted", "version": rollout["version"]})
        for gid, group in item["groups"].items():
            ops.hset(keys.group(gid), group)
        buffered += len(item["groups"])
    state["groups_buffered"] = buffered

    # Rollouts of the buffer and of a step kept in flight are still needed; a retention queue never holds them.
    needed = buffer_ids - set(adoption.trained_from_buffer)
    state["step_inflight"] = -1
    if step_doc and claimed is not None:
        record, step = step_doc["record"], claimed.step
        if adoption.claimed_adopted:
            ops.hset(keys.step(step), {**record, "state": "published", "published_ms": now}, retire=True)
            for gid, group in step_doc["groups"].items():
                ops.hset(keys.group(gid), {**group, "state": "trained", "ended_ms": now}, retire=True)
            for tid in claimed.task_ids:
                ops.hset(keys.task(tid), {"state": "admitted"}, retire=True)
            count("groups_trained", len(step_doc["groups"]))
            known.update({tid: step for tid in claimed.task_ids})  # trained into version ``step``
        else:
            ops.hset(keys.step(step), {**record, "sent_ms": 0})
            for gid, group in step_doc["groups"].items():
                ops.hset(keys.group(gid), group)
            for tid in claimed.task_ids:
                ops.hset(keys.task(tid), {"state": "admitted"})
            state["step_inflight"] = step
            needed.update(claimed.task_ids)
    ops.zadd(keys.rollout_retention, _rollout_retention(src, current, known, needed))

    for item in document["leases"]:
        lease = item["lease"]
        expires = int(lease["expires_ms"])
        if expires > now:
            ops.hset(keys.lease(item["lease_id"]), lease)
            ops.ops.append(["PEXPIRE", keys.lease(item["lease_id"]), str(expires - now)])
            ops.ops.append(["ZADD", keys.leases, str(expires), item["lease_id"]])

    if versions:
        ops.hset(keys.versions, versions)
    if counters:
        ops.hset(keys.counters, counters)
    if document["rejected_reasons"]:
        ops.hset(keys.rejected_reasons, document["rejected_reasons"])
    if document.get("prompt_attempts"):  # failed-attempt counts of prompts (invariant 9)
        ops.hset(keys.prompt_attempts, document["prompt_attempts"])
    ops.rpush(keys.requeue, requeue)
    ops.hset(keys.tracking, _tracking_fields(document.get("tracking", {}), now))
    state["incarnation"] = int(state.get("incarnation", 0)) + 1
    ops.hset(keys.state, state)
    return ops


def _tracking_fields(tracking: dict[str, Any], now_ms: int) -> dict[str, int]:
    """The ``tracking`` hash from the snapshot's compact form; each eval marked sent at the rebuild's time."""
    fields: dict[str, int] = {}
    for tracker, progress in tracking.items():
        fields[tracking_step_field(tracker)] = int(progress["step"])
        for version in progress["evals"]:
            fields[tracking_eval_field(tracker, int(version))] = now_ms // 1000
    return fields


def restore_state(store: RedisStore, bucket: Bucket, config: RunConfig) -> str:
    """Write the run's state into an empty Redis; returns 'fresh', 'rebuilt', 'rebuilt_from_versions' or
    'present' (someone else restored it first)."""
    src = _Sources(store, bucket, config)
    now = store.clock_ms()
    stored = load_stored_state(bucket, store.run)
    document = stored.document
    latest = latest_complete_version(bucket, store.run)
    if document is None:
        ops, outcome = _fresh_ops(src, latest, now)
    else:
        ops, outcome = _rebuild_ops(src, document, latest, now), "rebuilt"
    if stored.last_seq:  # the log goes on above every segment in the bucket, applied or not
        ops.hset(store.keys.log, {"seq": stored.last_seq})
    try:
        reply = store.scripts.restore_state(ops_json=json.dumps(ops.ops, separators=(",", ":")))
    except StateExists:
        return "present"
    log.info(
        "proxy.state_restored",
        run=store.run,
        outcome=outcome,
        latest_in_bucket=latest,
        log_segments=stored.segments,
        ops=reply["applied"],
    )
    return outcome
