"""Trackers for tests: real trackio in a temporary directory, what real wandb and mlflow stored read back, and a
wandb stand-in that raises.

trackio reads ``TRACKIO_DIR`` once, at import: ``trackio_dir()`` points it at one temporary directory for the
whole test session before the first import (each test logs to a project of its own), and the end-to-end test
hands the same directory to the proxy it starts. wandb in offline mode writes each run to a ``.wandb`` log
that has no public reader: ``wandb_offline_runs`` reads it into wandb's own record type. ``FAKE_WANDB`` is a
``wandb`` package whose ``init`` raises, put on a real proxy's PYTHONPATH to show that a tracker that fails
does not stop the run.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket
from asyncgrpo.protocol.records import StepRecord
from proxy.coordinator.redis_store import RunKeys

_SESSION_DIR: list[Path] = []


def trackio_dir() -> Path:
    """Where this process's trackio stores its projects (a temporary directory, set before its import)."""
    if not _SESSION_DIR:
        if "trackio" not in sys.modules:
            os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asyncgrpo-trackio-")
            atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)
        import trackio.utils

        _SESSION_DIR.append(Path(trackio.utils.TRACKIO_DIR))
    return _SESSION_DIR[0]


def trackio_logs(project: str, run: str) -> list[dict[str, Any]]:
    """Every row trackio stored for ``run``, in step order, read back through trackio's own storage."""
    trackio_dir()
    from trackio.sqlite_storage import SQLiteStorage

    return sorted(SQLiteStorage.get_logs(project, run), key=lambda row: row["step"])


def trackio_config(project: str, run: str) -> dict[str, Any] | None:
    trackio_dir()
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_run_config(project, run)


@dataclass
class WandbOfflineRun:
    """One offline run directory's log: the run (id, config), its metric definitions, history rows, and the
    kinds of record it holds (``output_raw``: the process's console)."""

    run_id: str
    start_time: datetime
    config: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    record_kinds: set[str] = field(default_factory=set)


_BLOCK = 32 * 1024  # the LevelDB log format wandb writes: 32 KiB blocks of 7-byte-headed chunks
_FULL, _LAST = 1, 4


def _wandb_records(path: Path) -> list[Any]:
    from google.protobuf.json_format import MessageToDict
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb log"
    records, chunks, position = [], b"", 7  # after the file header: ':W&B', magic, version
    while position + 7 <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left_in_block < 7 or (length == 0 and kind == 0):  # a block's zero-filled tail
            position += left_in_block
            continue
        chunks += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (_FULL, _LAST):
            record = Record()
            record.ParseFromString(chunks)
            records.append(MessageToDict(record, preserving_proto_field_name=True))
            chunks = b""
    return records


def wandb_offline_runs(wandb_dir: Path) -> list[WandbOfflineRun]:
    """Every offline run under ``WANDB_DIR``, oldest first, as wandb logged it (values JSON-decoded)."""
    runs = []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run: WandbOfflineRun | None = None
        records = _wandb_records(path)
        for record in records:
            if "run" in record:
                updates = record["run"].get("config", {}).get("update", [])
                config = {_key(item): json.loads(item["value_json"]) for item in updates}
                run = WandbOfflineRun(
                    record["run"]["run_id"], datetime.fromisoformat(record["run"]["start_time"]), config
                )
            elif "metric" in record and run is not None:
                run.metrics.append(record["metric"])
            elif "history" in record and run is not None:
                items = record["history"]["item"]
                run.history.append({_key(item): json.loads(item["value_json"]) for item in items})
        assert run is not None, f"{path} holds no run record"
        run.record_kinds = {kind for record in records for kind in record}
        runs.append(run)
    return sorted(runs, key=lambda run: run.start_time)


def _key(item: dict[str, Any]) -> str:
    return item.get("key") or "/".join(item["nested_key"])


FAKE_WANDB = '''\
"""A wandb stand-in whose every call raises, as a tracker with a wrong key or no network would."""


class Settings:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


def init(**kwargs):
    raise RuntimeError("fake wandb: init refused")
'''


def write_fake_wandb(folder: Path) -> Path:
    """A folder to put first on PYTHONPATH: ``import wandb`` there gets a library that always raises."""
    package = folder / "wandb"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(FAKE_WANDB)
    return folder


# ---- what a run leaves for the forwarder: step records, eval records, the current version ----

RUN = "r1"


def step_record(step: int, **changes: Any) -> StepRecord:
    """A published step record of run ``RUN`` (also used by tests/integration/test_tracker_libraries.py)."""
    data = {
        "run": RUN, "step": step, "version": step, "base_version": step - 1, "worker_id": "opt-1",
        "published_at": 1.7e9, "samples": 4, "groups": 1, "tokens": 18, "reward_mean": 0.25 * step,
        "reward_std": 0.5, "rewards_by_name": {"repeat_digit": 0.25 * step, "format": None},
        "rewards_std_by_name": {"repeat_digit": 0.5, "format": None}, "completion_length_mean": 4.5,
        "truncated_fraction": 0.25, "staleness": [1], "max_staleness": 1, "ratio": 1.0, "rescore_ratio": 0.999,
        "kl": 0.002, "entropy": 1.25, "clip_low": 0.0, "clip_high": 0.01, "clip_region": 0.02, "loss": 0.1,
        "grad_norm": 0.5, "lr": 1e-3,
        "updates": [{"update": 2 * step - 1, "loss": 0.1, "ratio": 1.0, "kl": 0.002, "clip_low": 0.0,
                     "clip_high": 0.01, "clip_region": 0.02, "entropy": 1.25, "grad_norm": 0.5, "lr": 1e-3,
                     "tokens": 18, "sequences": 4, "micro_batches": 1, "forward_backward_s": 0.2,
                     "optimizer_s": 0.01}],
        "rollouts": [{"task_id": "t1", "version": step - 1, "worker_id": "gen-1", "ratio": 1.0,
                      "group_ids": ["t1.0"], "prompt_indices": [4], "samples": 4}],
        "flagged_rollouts": [], "timings": {"fetch_s": 0.01, "step_s": 0.9},
    }  # fmt: skip
    return StepRecord.model_validate({**data, **changes})


def publish_step(redis_client: redis.Redis, bucket: Bucket, *steps: int) -> None:
    """What a publish leaves for the forwarder: the step record in metrics/, the current version in Redis."""
    for step in steps:
        bucket.put(bucket_keys.metrics_key(RUN, step), step_record(step).model_dump_json().encode())
        redis_client.hset(RunKeys(RUN).state, "current_version", step)


def put_eval(bucket: Bucket, version: int, metrics: dict[str, float]) -> None:
    """The eval record the proxy writes for ``version`` (only its ``metrics`` reach a tracker)."""
    bucket.put(bucket_keys.eval_key(RUN, version), json.dumps({"version": version, "metrics": metrics}).encode())


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
