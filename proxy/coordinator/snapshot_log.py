"""The snapshot log: what changed since the last full snapshot, and how a rebuild replays it onto the snapshot.

A group commit used to put the whole state (``lua/snapshot/snapshot_json.lua``): about 190 KB and 16 ms of Redis
CPU with 1,000 generate tasks in flight, for every admitted rollout. Now it puts one **segment**,
``runs/<run>/proxy/log/<seq>.json``, holding only what changed since the segment before, create-only
(``If-None-Match``). Every so often (``CompactionPolicy``) the group commit puts the whole snapshot instead,
conditionally over the one it last wrote (``If-Match``); the snapshot records the log number it covers
(``log_through``), and the segments up to that number are deleted after it. A rebuild reads the snapshot and
applies the segments above ``log_through`` in order (``Replay``), then restores the result exactly as it
restored a snapshot before. "Admitted" still means recoverable from the bucket before the answer: the segment
holding the change is in the bucket before any caller it covers is answered.

What a segment holds, and where it comes from. Every script writes through ``call()`` (``lua/prelude.lua``),
which notes what each write touched: a field of one of the snapshot's hashes, a member of one of its sorted sets,
a group, task, rollout, lease or step record, or (for the ``buffer`` and ``requeue`` lists) the write itself, in
order. ``lua/snapshot/log_segment.lua`` turns the notes into the segment, reading each noted thing's value at
that moment, and clears them in the same atomic step; compaction clears them atomically with its full read.
So segment ``n`` holds exactly the changes between the state segment ``n - 1`` (or the compaction) saw and the
state it saw, and the snapshot plus the segments equal the state (``tests/integration/test_snapshot_log.py``
checks it after every operation of a randomized run).

- ``hashes``: {section: {field: value, or null where the field was deleted}}, for ``state``, ``counters``,
  ``rejected_reasons``, ``versions``, ``prompt_attempts`` and ``tracking``;
- ``whole``: a section whose key was deleted, read whole;
- ``lists``: ``[section, command, args...]`` for ``RPUSH``, ``LPUSH``, ``LPOP``, ``LREM`` and ``DEL`` on the buffer
  and the requeue line. Order is all a replay needs: ``LPOP``'s member is only in its reply;
- ``zsets``: {section: {member: score, or null where it was removed}} for ``tasks_inflight``, ``leases`` and
  ``rollout_retention``;
- ``items``: {kind: {id: record, or null where it was deleted}}. A task or rollout comes with all its groups,
  a step with all the groups of its batch, so one that enters the buffer, the tasks in flight or the step is
  whole in the segment that puts it there.

The document a replay gives is the one ``snapshot_json`` makes from the same state, field for field: buffer in
list order, tasks in flight and leases in sorted-set order (score, then id), the step in flight with its batch's
groups, tracking compacted to the last step and the sorted eval versions per tracker.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from proxy.coordinator.redis_store import GROUP_KIND, LEASE_KIND, ROLLOUT_KIND, STEP_KIND, TASK_KIND

HASH_SECTIONS = ("state", "counters", "rejected_reasons", "versions", "prompt_attempts")
"""The hashes the document holds as they are (``tracking`` is compacted: ``Replay._track``)."""

LIST_SECTIONS = ("buffer", "requeue")
ZSET_SECTIONS = ("tasks_inflight", "leases", "rollout_retention")

HEADER_FIELDS = ("format", "run", "proxy_epoch", "written_at_ms", "log_through")
"""The document's fields that say what wrote it, not what the run's state is."""


@dataclass(frozen=True)
class CompactionPolicy:
    """When the group commit puts the whole snapshot instead of a segment.

    Once the segments since the last compaction weigh as much as the snapshot, a compaction costs no more than
    they did together, so the bytes written per commit stay proportional to what changed, whatever the number
    of tasks in flight; a rebuild then reads at most about twice the snapshot. ``max_segments`` bounds the
    objects a rebuild reads while the snapshot is small."""

    max_segments: int = 256
    log_to_snapshot: float = 1.0

    def due(self, segments: int, log_bytes: int, snapshot_bytes: int) -> bool:
        return segments >= self.max_segments or log_bytes >= self.log_to_snapshot * snapshot_bytes


def _groups(ids: Any) -> list[str]:
    return [str(gid) for gid in ids]


class Replay:
    """A snapshot document with segments applied in order; ``document()`` is the run's state after the last one."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.header = {name: document[name] for name in HEADER_FIELDS if name in document}
        self.hashes: dict[str, dict[str, str]] = {name: dict(document.get(name, {})) for name in HASH_SECTIONS}
        self.trackers: dict[str, tuple[int, set[int]]] = {
            name: (int(progress["step"]), {int(v) for v in progress["evals"]})
            for name, progress in document.get("tracking", {}).items()
        }
        self.lists: dict[str, list[str]] = {
            "requeue": [str(index) for index in document["requeue"]],  # LRANGE's strings, as snapshot_json keeps them
            "buffer": [item["task_id"] for item in document["buffer"]],
        }
        self.items: dict[str, dict[str, dict[str, str]]] = {
            kind: {} for kind in (GROUP_KIND, TASK_KIND, ROLLOUT_KIND, LEASE_KIND, STEP_KIND)
        }
        groups = self.items[GROUP_KIND]
        for item in document["buffer"]:
            self.items[ROLLOUT_KIND][item["task_id"]] = item["rollout"]
            groups.update(item["groups"])
        # The scores of the base's sorted sets are in its records: ZADD is always given the task's deadline_ms
        # and the lease's expires_ms (dispatch_generate.lua, grant_lease.lua, renew_lease.lua).
        inflight: dict[str, float] = {}
        for item in document["inflight_tasks"]:
            self.items[TASK_KIND][item["task_id"]] = item["task"]
            inflight[item["task_id"]] = float(item["task"].get("deadline_ms", 0))
            groups.update(item["groups"])
        step = document.get("step")
        if step is not None:
            self.items[STEP_KIND][str(_lua_int(self.hashes["state"].get("step_inflight"), -1))] = step["record"]
            groups.update(step["groups"])
        leases: dict[str, float] = {}
        for item in document["leases"]:
            self.items[LEASE_KIND][item["lease_id"]] = item["lease"]
            leases[item["lease_id"]] = float(item["lease"].get("expires_ms", 0))
        self.zsets: dict[str, dict[str, float]] = {
            "tasks_inflight": inflight,
            "leases": leases,
            "rollout_retention": {tid: float(v) for tid, v in document.get("rollout_retention", {}).items()},
        }
        self.applied = 0

    # ---- applying one segment ----

    def apply(self, segment: dict[str, Any]) -> None:
        for section, value in segment.get("whole", {}).items():
            if section == "tracking":
                self.trackers = {}
                for name, field_value in value.items():
                    self._track(name, field_value)
            elif section in ZSET_SECTIONS:
                self.zsets[section] = {member: float(score) for member, score in value.items()}
            else:
                self.hashes[section] = dict(value)
        for section, fields in segment.get("hashes", {}).items():
            for name, field_value in fields.items():
                if section == "tracking":
                    self._track(name, field_value)
                elif field_value is None:
                    self.hashes[section].pop(name, None)
                else:
                    self.hashes[section][name] = field_value
        for op in segment.get("lists", []):
            self._list_op(op)
        for section, members in segment.get("zsets", {}).items():
            zset = self.zsets[section]
            for member, score in members.items():
                if score is None:
                    zset.pop(member, None)
                else:
                    zset[member] = float(score)
        for kind, records in segment.get("items", {}).items():
            store = self.items[kind]
            for item_id, record in records.items():
                if record is None:
                    store.pop(item_id, None)
                else:
                    store[item_id] = record
        for name in ("proxy_epoch", "written_at_ms"):
            if name in segment:
                self.header[name] = segment[name]
        self.header["log_through"] = segment["seq"]
        self.applied += 1

    def _list_op(self, op: list[Any]) -> None:
        section, command, args = op[0], op[1], [str(arg) for arg in op[2:]]
        line = self.lists[section]
        if command == "RPUSH":
            line.extend(args)
        elif command == "LPUSH":
            for value in args:
                line.insert(0, value)
        elif command == "LPOP":
            del line[: int(args[0]) if args else 1]
        elif command == "LREM":
            self._lrem(line, int(args[0]), args[1])
        elif command == "DEL":
            line.clear()
        else:
            raise ValueError(f"a log segment holds {command} on {section}, which no replay knows")

    @staticmethod
    def _lrem(line: list[str], count: int, value: str) -> None:
        """Redis ``LREM``: the first ``count`` from the head (from the tail if negative; all if 0)."""
        order = range(len(line)) if count >= 0 else range(len(line) - 1, -1, -1)
        hits = [i for i in order if line[i] == value][: abs(count) or None]
        for i in sorted(hits, reverse=True):
            del line[i]

    def _track(self, name: str, value: str | None) -> None:
        """One ``tracking`` hash field, as ``snapshot_json.lua`` compacts it: ``<tracker>:step`` and
        ``<tracker>:eval:<version>``."""
        tracker, sep, what = name.partition(":")
        if not sep or not tracker or not what:
            return
        step, evals = self.trackers.get(tracker, (0, set()))
        if what == "step":
            step = _lua_int(value) if value is not None else 0
        elif what.startswith("eval:") and what[5:].isdigit():
            if value is None:
                evals.discard(int(what[5:]))
            else:
                evals.add(int(what[5:]))
        self.trackers[tracker] = (step, evals)

    # ---- the document ----

    def _with_groups(self, head: dict[str, Any], ids_json: str | None) -> dict[str, Any]:
        groups = self.items[GROUP_KIND]
        ids = _groups(json.loads(ids_json)) if ids_json else []
        return {**head, "groups": {gid: groups.get(gid, {}) for gid in ids}}

    def document(self) -> dict[str, Any]:
        """The state as ``snapshot_json.lua`` would write it (with this replay's header)."""
        rollouts, tasks, leases = self.items[ROLLOUT_KIND], self.items[TASK_KIND], self.items[LEASE_KIND]
        buffer = [
            self._with_groups(
                {"task_id": tid, "rollout": rollouts.get(tid, {})}, rollouts.get(tid, {}).get("group_ids")
            )
            for tid in self.lists["buffer"]
        ]
        inflight = [
            self._with_groups({"task_id": tid, "task": tasks.get(tid, {})}, tasks.get(tid, {}).get("group_ids"))
            for tid in _ordered(self.zsets["tasks_inflight"])
        ]
        step: dict[str, Any] | None = None
        number = _lua_int(self.hashes["state"].get("step_inflight"), -1)
        if number >= 0:
            record = self.items[STEP_KIND].get(str(number), {})
            groups = self.items[GROUP_KIND]
            ids = [gid for ref in json.loads(record.get("rollouts", "[]")) for gid in _groups(ref["group_ids"])]
            step = {"record": record, "groups": {gid: groups.get(gid, {}) for gid in ids}}
        return {
            **self.header,
            **{name: self.hashes[name] for name in ("state", "counters", "rejected_reasons", "versions")},
            "requeue": list(self.lists["requeue"]),
            "buffer": buffer,
            "inflight_tasks": inflight,
            "step": step,
            "leases": [
                {"lease_id": lid, "lease": leases[lid]} for lid in _ordered(self.zsets["leases"]) if leases.get(lid)
            ],
            "rollout_retention": {tid: math.floor(v) for tid, v in self.zsets["rollout_retention"].items()},
            "prompt_attempts": self.hashes["prompt_attempts"],
            "tracking": {
                name: {"step": self.trackers[name][0], "evals": sorted(self.trackers[name][1])}
                for name in sorted(self.trackers)
            },
        }


def _ordered(zset: dict[str, float]) -> list[str]:
    """Members in Redis sorted-set order: by score, then by member."""
    return [member for member, _ in sorted(zset.items(), key=lambda item: (item[1], item[0]))]


def _lua_int(value: str | None, default: int = 0) -> int:
    """Lua's ``tonumber(v) or default``, as the scripts read a number field."""
    try:
        return int(float(value)) if value is not None else default
    except ValueError:
        return default


def state_sections(document: dict[str, Any]) -> dict[str, Any]:
    """The document without the fields that say who wrote it and when: what two documents of one state share."""
    return {name: value for name, value in document.items() if name not in (*HEADER_FIELDS, "sha256")}
