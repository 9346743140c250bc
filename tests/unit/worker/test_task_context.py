"""A generate or eval task's set-up (``TaskContext.leased_adapter``) and the corrupt-object report both roles
make (``worker.corrupt_report``): a real file bucket, a real adapter cache; the proxy and the backend are
recording fakes (only what they were asked is checked)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.bucket.layout import IntegrityError, write_version
from asyncgrpo.protocol.errors import ProxyUnavailable
from asyncgrpo.protocol.schemas import CorruptResult, LeaseGrant, ReleaseResult
from asyncgrpo.run.config import RunConfig
from worker.corrupt_report import report_corrupt
from worker.generate.adapter_cache import AdapterCache
from worker.generate.task_context import TaskContext

RUN = "ctx-run"
FILES = {bucket_keys.ADAPTER_CONFIG_NAME: b'{"r": 2}', bucket_keys.ADAPTER_WEIGHTS_NAME: b"weights"}


@dataclass
class RecordingProxy:
    corrupt: list[tuple[int, str, str]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    down: bool = False

    def renew(self, lease_id: str) -> LeaseGrant:
        raise AssertionError("a short block renews nothing")

    def release(self, lease_id: str) -> ReleaseResult:
        self.released.append(lease_id)
        return ReleaseResult(released=True)

    def report_corrupt(self, version: int, worker_id: str, key: str) -> CorruptResult:
        if self.down:
            raise ProxyUnavailable("proxy restarting")
        self.corrupt.append((version, worker_id, key))
        return CorruptResult(action="repair_sent")


@dataclass
class RecordingBackend:
    lock: threading.RLock
    loaded: dict[str, tuple[int, Path, bool]] = field(default_factory=dict)
    name: str = "fake"

    def load_adapter(self, name: str, version: int, path: Path) -> None:
        # Whether the task holds the worker's backend lock while it loads (the prefetcher's lock).
        self.loaded[name] = (version, path, self.lock._is_owned())  # type: ignore[attr-defined]

    def drop_adapter(self, name: str) -> None:
        self.loaded.pop(name, None)


def context_of(bucket: Bucket, tmp_path: Path, proxy: RecordingProxy) -> tuple[TaskContext, RecordingBackend]:
    lock = threading.RLock()
    backend = RecordingBackend(lock)
    cache = AdapterCache(bucket, RUN, tmp_path / "cache", capacity=2, backend=backend)  # type: ignore[arg-type]
    context = TaskContext(
        run=RUN,
        config=RunConfig(),
        bucket=bucket,
        client=proxy,  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
        adapter_cache=cache,
        worker_id="gen-1",
        backend_lock=lock,
    )
    return context, backend


@pytest.fixture
def bucket(tmp_path: Path) -> Bucket:
    return open_bucket(f"file://{tmp_path / 'bucket'}")


def test_the_leased_version_is_fetched_verified_and_loaded_under_the_backend_lock(
    bucket: Bucket, tmp_path: Path
) -> None:
    _, manifest_sha = write_version(bucket, RUN, 3, FILES, {"step": 3})
    proxy = RecordingProxy()
    context, backend = context_of(bucket, tmp_path, proxy)
    with context.leased_adapter("lease-1", 30.0, 3, manifest_sha) as (renewer, adapter):
        assert adapter == "v3" and not renewer.lost
        version, path, locked = backend.loaded["v3"]
        assert version == 3 and locked
        assert {p.name: p.read_bytes() for p in path.iterdir() if p.name in FILES} == FILES
    # A clean block hands the lease on to the submission: nothing released here.
    assert proxy.released == [] and proxy.corrupt == []
    assert context.adapter_cache.versions() == [3]


def test_a_failed_block_releases_the_lease(bucket: Bucket, tmp_path: Path) -> None:
    _, manifest_sha = write_version(bucket, RUN, 0, FILES, {"step": 0})
    proxy = RecordingProxy()
    context, _ = context_of(bucket, tmp_path, proxy)
    with pytest.raises(RuntimeError, match="sampling broke"), context.leased_adapter("lease-2", 30.0, 0, manifest_sha):
        raise RuntimeError("sampling broke")
    deadline = time.monotonic() + 10
    while not proxy.released and time.monotonic() < deadline:  # the renewal thread releases on its way out
        time.sleep(0.01)
    assert proxy.released == ["lease-2"]


def test_a_corrupted_object_is_reported_then_raised_and_nothing_is_loaded(bucket: Bucket, tmp_path: Path) -> None:
    manifest, manifest_sha = write_version(bucket, RUN, 1, FILES, {"step": 1})
    key = manifest.file_key(RUN, bucket_keys.ADAPTER_WEIGHTS_NAME)
    bucket.put(key, b"flipped bits")
    proxy = RecordingProxy()
    context, backend = context_of(bucket, tmp_path, proxy)
    with (
        capture_logs() as events,
        pytest.raises(IntegrityError),
        context.leased_adapter("lease-3", 30.0, 1, manifest_sha),
    ):
        raise AssertionError("the block must not run on a corrupted version")
    assert proxy.corrupt == [(1, "gen-1", key)]
    assert backend.loaded == {} and context.adapter_cache.versions() == []
    reported = [e for e in events if e["event"] == "generate.corrupt_reported"]
    assert reported and reported[0]["action"] == "repair_sent" and reported[0]["key"] == key


def test_a_failed_corrupt_report_is_only_logged_under_the_role_name() -> None:
    proxy = RecordingProxy(down=True)
    error = IntegrityError("bad sha", key="runs/r/adapters/v00000002/x")
    with capture_logs() as events:
        report_corrupt(proxy, 2, "opt-1", error, role="optimize")  # type: ignore[arg-type]
    assert [e["event"] for e in events] == ["optimize.corrupt_report_failed"]
    assert events[0]["version"] == 2 and "restarting" in events[0]["error"]


def test_tools_of_is_none_without_agent_and_scoring_models_default_to_none_loaded(
    bucket: Bucket, tmp_path: Path
) -> None:
    context, _ = context_of(bucket, tmp_path, RecordingProxy())
    assert context.tools_of is None
    assert context.scoring_models.score_groups(list(RunConfig().rewards), ["1="], [[]], [["1"]]) == [{}]
