"""Snapshot of a run's coordinator state in the bucket: the document, its writer and its reader.

``runs/<run>/proxy/snapshot.json`` holds what is needed to go on (invariant 6): the current version and the
manifest sha256 of each published version, the prompt order position, the requeue line, every admitted and
not yet trained rollout with its groups, the step in flight, the generate tasks in flight, live leases,
the rollout retention queue and all counters. The coordinator writes it after every change that matters,
always before it tells a worker that a rollout was admitted and before it sends any task (so a rebuilt proxy
never hands out work twice under one name). ``proxy.coordinator.rebuild`` reads it back into an empty Redis.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from proxy.coordinator.errors import SnapshotFailed, StateMissing
from proxy.coordinator.store import RunStore
from proxy.storage import bucket_keys
from proxy.storage.bucket import Bucket, BucketError, ObjectNotFound

SNAPSHOT_FORMAT = 1


class SnapshotCorrupt(Exception):
    """The snapshot in the bucket cannot be read; the message names the key and what to do."""


def pairs(flat: list[str]) -> dict[str, str]:
    """A Redis hash as HGETALL flattens it, as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _groups(items: list[list[Any]]) -> dict[str, dict[str, str]]:
    return {gid: pairs(record) for gid, record in items}


def read_state_document(store: RunStore) -> dict[str, Any] | None:
    """The run's state, read atomically from Redis, as the snapshot document; None if Redis has none."""
    try:
        reply = store.scripts.read_snapshot()
    except StateMissing:
        return None
    buffer, tasks, step, leases = reply["buffer"], reply["tasks"], reply["step"], reply["leases"]
    return {
        "format": SNAPSHOT_FORMAT,
        "run": store.run,
        "written_at_ms": store.clock_ms(),
        "state": pairs(reply["state"]),
        "counters": pairs(reply["counters"]),
        "rejected_reasons": pairs(reply["reasons"]),
        "versions": pairs(reply["versions"]),
        "requeue": list(reply["requeue"]),
        "buffer": [
            {"task_id": tid, "rollout": pairs(rollout), "groups": _groups(groups)} for tid, rollout, groups in buffer
        ],
        "inflight_tasks": [
            {"task_id": tid, "task": pairs(task), "groups": _groups(groups)} for tid, task, groups in tasks
        ],
        "step": {"record": pairs(step[0]), "groups": _groups(step[1])} if step else None,
        "leases": [{"lease_id": lease_id, "lease": pairs(lease)} for lease_id, lease in leases if lease],
        # task id -> version after which its rollout object may be deleted
        "rollout_retention": {tid: int(float(score)) for tid, score in pairs(reply["retention"]).items()},
    }


def load_snapshot(bucket: Bucket, run: str) -> dict[str, Any] | None:
    """The run's snapshot document from the bucket; None if there is none."""
    key = bucket_keys.proxy_snapshot_key(run)
    try:
        data = bucket.get(key)
    except ObjectNotFound:
        return None
    try:
        document = json.loads(data)
    except json.JSONDecodeError as error:
        raise SnapshotCorrupt(
            f"{key} is not valid JSON ({error}); restore it from a backup, or delete it to restart the run's "
            "prompt order from the latest complete version"
        ) from error
    if document.get("format") != SNAPSHOT_FORMAT or document.get("run") != run:
        raise SnapshotCorrupt(
            f"{key} has format {document.get('format')!r} for run {document.get('run')!r}; this proxy reads "
            f"format {SNAPSHOT_FORMAT} of run {run!r}"
        )
    return document


class SnapshotWriter:
    """Writes the snapshot when the store counted a change since the last one (one writer at a time)."""

    def __init__(self, store: RunStore, bucket: Bucket) -> None:
        self.store = store
        self.bucket = bucket
        self._lock = threading.Lock()
        self._written_changes = -1

    def write(self, *, force: bool = False) -> bool:
        """Write ``runs/<run>/proxy/snapshot.json`` if anything changed since the last one; True if written."""
        with self._lock:
            target = self.store.changes
            if not force and target == self._written_changes:
                return False
            document = read_state_document(self.store)
            if document is None:
                return False
            try:
                self.bucket.put(
                    bucket_keys.proxy_snapshot_key(self.store.run),
                    json.dumps(document, separators=(",", ":"), sort_keys=True).encode(),
                )
            except (BucketError, OSError) as error:
                raise SnapshotFailed(
                    f"could not write the proxy snapshot of run {self.store.run!r}: {error}"
                ) from error
            self._written_changes = target
            return True
