"""The proxy's forwarder: each published step record and each eval result, sent to the run's trackers.

One daemon thread per tracker (``TrackerFollower``), never the housekeeping loop's: a slow or hung tracker
delays nothing but itself. It follows the bucket, not the publish path: the step records the proxy copies to
``runs/<run>/metrics/step-S.json`` at each publish, in step order, then the eval records
(``runs/<run>/evals/v00000042.json``) of versions it has already sent the step of, each logged at its version.
The tracker's step is the published version (the record's ``step``; with ``async.publish_every`` > 1 a
version holds several optimizer updates, logged as ``asyncgrpo/optimizer_steps``).

Progress is kept in Redis (``RunKeys.tracking``: ``<tracker>:step`` the last step sent, ``<tracker>:eval:<v>``
each eval sent), so a restarted or stand-by proxy goes on where the last one stopped and sends nothing twice
(a record is marked sent right after the tracker accepted it; a proxy killed in between sends it again). Only
the proxy holding the run's leadership forwards: the threads stop once it is lost.

The progress survives an empty Redis: each advance calls ``on_progress`` (the server's: the coordinator's
``store.mark_changed``), so the next housekeeping tick (``tick_s``) puts it in the snapshot, and a rebuild
restores it (``proxy.coordinator.snapshot``). A tracker gets again at most what it was sent after the last
snapshot put before Redis emptied: one tick's worth, more only while the bucket refuses snapshots. While Redis
holds no state for the run a follower sends nothing (it would start again from step 1) and waits for the
rebuild (a write of its progress is refused once the state is gone: ``RedisStore.write_logged_field``, so it
leaves no partial state in an emptied Redis); a running follower never moves its cursor back (it keeps the
highest step it sent and writes it over an older restored one).

A tracker never stops the run. Every exception from it (start, log, finish) is logged as
``proxy.tracker_failed`` with the tracker's name and counted in ``asyncgrpo_tracker_errors_total{tracker}``;
the follower retries after a backoff doubling from 1 s to 5 min. A record the tracker refused
``RECORD_ATTEMPTS`` times is skipped (``proxy.tracker_record_skipped``), so one bad record cannot stall the
tracker; a start is retried for as long as the proxy runs (a tracker server may come back). A tracker whose
library is not installed is left out at start-up with a warning naming its extra.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import ValidationError
from redis import Redis

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectNotFound
from asyncgrpo.protocol.records import StepRecord
from asyncgrpo.run.config import RunConfig
from proxy.coordinator.redis_store import RedisStore, tracking_eval_field, tracking_eval_prefix, tracking_step_field
from proxy.coordinator.scripts import StateMissing
from proxy.tracking.metric_names import eval_metrics, step_metrics
from proxy.tracking.trackers import TRACKERS, Tracker, TrackerRun, install_hint

log = structlog.get_logger()

POLL_S = 2.0
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 300.0
RECORD_ATTEMPTS = 5
STOP_TIMEOUT_S = 10.0


class TrackerMetrics:
    """The forwarder's Prometheus series, in the proxy's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter(
            "asyncgrpo_tracker_errors",
            "Calls to an experiment tracker that raised (start, log, finish), or its library missing; the run goes on.",
            ["tracker"],
            registry=registry,
        )
        self.step = Gauge(
            "asyncgrpo_tracker_step", "The last step the proxy sent to the tracker.", ["tracker"], registry=registry
        )


class TrackerFollower:
    """One tracker's thread: sends the steps after its cursor in order, then the evals it has not sent."""

    def __init__(
        self,
        tracker: Tracker,
        *,
        redis: Redis,
        bucket: Bucket,
        run: str,
        metrics: TrackerMetrics,
        keep_going: Callable[[], bool] = lambda: True,
        on_progress: Callable[[], object] = lambda: None,
        poll_s: float = POLL_S,
    ) -> None:
        """``on_progress``: called after each record marked sent (the server: mark a snapshot change)."""
        self.tracker = tracker
        self.redis = redis
        self.bucket = bucket
        self.run = run
        self.store = RedisStore(redis, run)
        self.keys = self.store.keys
        self.metrics = metrics
        self.keep_going = keep_going
        self.on_progress = on_progress
        self.poll_s = poll_s
        self._sent_through = 0  # the highest step this follower sent: a restored older cursor never wins
        self.started = False
        self.backoff_s = 0.0
        self._attempts: dict[str, int] = {}
        self._evals_sent: set[int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tracker-{tracker.name}", daemon=True)
        metrics.errors.labels(tracker.name)  # the series exist from the start
        metrics.step.labels(tracker.name)

    # ---- the thread ----

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        self._stop.set()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the thread to finish the tracker run and end; a hung tracker is left behind (daemon)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set() and self.keep_going():
            try:
                self.forward_once()
            except Exception as error:  # Redis or the bucket, not the tracker: next round tries again
                log.warning("proxy.tracking_round_failed", tracker=self.tracker.name, error=repr(error))
            self._stop.wait(self.backoff_s or self.poll_s)
        self.finish()

    # ---- one round ----

    def forward_once(self) -> int:
        """Send what is new; return how many records the tracker took."""
        try:
            return self._forward()
        except StateMissing:  # Redis emptied during the round: nothing was written; wait for the rebuild
            return 0

    def _forward(self) -> int:
        if not self.started:
            self.started = self._call("start", self.tracker.start)
            if not self.started:
                return 0
        if not self.redis.exists(self.keys.state):
            return 0  # Redis emptied: the rebuild restores the progress; until then the cursor would read 0
        sent = 0
        stored = self._stored_cursor()
        cursor = max(stored, self._sent_through)
        if cursor > stored:  # a rebuild restored an older snapshot's cursor
            self._mark_step(cursor)
        self.metrics.step.labels(self.tracker.name).set(cursor)
        while not self._stop.is_set():
            step = cursor + 1
            record = self._step_record(step)
            if record is not None:
                metrics = step_metrics(record)
                if not self._send(f"step {step}", lambda m=metrics, s=step: self.tracker.log(m, s)):
                    return sent
                sent += 1
            elif step >= self._current_version():
                break  # not published yet, or its record is being copied
            else:
                log.warning("proxy.tracker_step_missing", tracker=self.tracker.name, step=step)
            cursor = step
            self._mark_step(cursor)
            self.metrics.step.labels(self.tracker.name).set(cursor)
        for version in self._evals_to_send(cursor):
            if self._stop.is_set():
                break
            record = self._eval_record(version)
            if record is not None:
                if not self._send(
                    f"eval {version}", lambda r=record, v=version: self.tracker.log_eval(eval_metrics(r), v)
                ):
                    return sent
                sent += 1
            self.store.write_logged_field("tracking", tracking_eval_field(self.tracker.name, version), int(time.time()))
            self._evals_sent.add(version)  # type: ignore[union-attr]
            self.on_progress()
        return sent

    def finish(self) -> None:
        if self.started:
            self._call("finish", self.tracker.finish)
            self.started = False

    # ---- progress and records ----

    def _stored_cursor(self) -> int:
        """The last step sent to this tracker, as Redis has it (0: none; version 0 has no record)."""
        return int(self.redis.hget(self.keys.tracking, tracking_step_field(self.tracker.name)) or 0)

    def _mark_step(self, step: int) -> None:
        self._sent_through = max(self._sent_through, step)  # the tracker has it, whether or not Redis takes it
        self.store.write_logged_field("tracking", tracking_step_field(self.tracker.name), step)
        self.on_progress()

    def _current_version(self) -> int:
        return int(self.redis.hget(self.keys.state, "current_version") or 0)

    def _step_record(self, step: int) -> StepRecord | None:
        key = bucket_keys.metrics_key(self.run, step)
        try:
            return StepRecord.model_validate_json(self.bucket.get(key))
        except ObjectNotFound:
            return None
        except ValidationError as error:  # sent as nothing rather than stalling every later step
            log.warning("proxy.tracker_record_unreadable", tracker=self.tracker.name, key=key, error=str(error))
            return None

    def _evals_to_send(self, cursor: int) -> list[int]:
        """Evaluated versions whose step was sent (so an eval never precedes its step), not sent yet."""
        if self._evals_sent is None:
            prefix = tracking_eval_prefix(self.tracker.name)
            fields = self.redis.hkeys(self.keys.tracking)
            self._evals_sent = {int(field[len(prefix) :]) for field in fields if field.startswith(prefix)}
        versions = []
        for key in self.bucket.list(bucket_keys.evals_prefix(self.run)):
            version = bucket_keys.version_from_eval_key(key)
            if version is not None and version <= cursor and version not in self._evals_sent:
                versions.append(version)
        return sorted(versions)

    def _eval_record(self, version: int) -> dict[str, Any] | None:
        key = bucket_keys.eval_key(self.run, version)
        try:
            record = json.loads(self.bucket.get(key))
        except (ObjectNotFound, ValueError) as error:
            log.warning("proxy.tracker_record_unreadable", tracker=self.tracker.name, key=key, error=str(error))
            return None
        return record if isinstance(record, dict) else None

    # ---- calls into the tracker ----

    def _call(self, phase: str, call: Callable[[], object]) -> bool:
        """Run one tracker call; on an exception log, count and back off. True when it returned."""
        try:
            call()
        except Exception as error:  # any failure of a third-party tracker; it must not end the thread
            self.metrics.errors.labels(self.tracker.name).inc()
            self.backoff_s = min(max(self.backoff_s * 2, FIRST_BACKOFF_S), MAX_BACKOFF_S)
            log.warning(
                "proxy.tracker_failed",
                tracker=self.tracker.name,
                phase=phase,
                error=repr(error),
                retry_in_s=self.backoff_s,
            )
            return False
        self.backoff_s = 0.0
        return True

    def _send(self, what: str, call: Callable[[], object]) -> bool:
        """True when the record is done with: taken by the tracker, or skipped after too many refusals."""
        if self._call(f"log {what}", call):
            self._attempts.pop(what, None)
            return True
        self._attempts[what] = self._attempts.get(what, 0) + 1
        if self._attempts[what] < RECORD_ATTEMPTS:
            return False
        log.error("proxy.tracker_record_skipped", tracker=self.tracker.name, record=what, attempts=RECORD_ATTEMPTS)
        self._attempts.pop(what)
        return True


class Forwarder:
    """The followers of one proxy process, started and stopped together."""

    def __init__(self, followers: list[TrackerFollower]) -> None:
        self.followers = followers

    def start(self) -> Forwarder:
        for follower in self.followers:
            follower.start()
        return self

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for follower in self.followers:
            follower.request_stop()
        for follower in self.followers:
            follower.stop(max(0.0, deadline - time.monotonic()))


def build_trackers(config: RunConfig, run: str, metrics: TrackerMetrics) -> list[Tracker]:
    """The adapters of ``tracking.report_to`` whose library is installed (a missing one: warned and counted)."""
    target = TrackerRun(
        project=config.tracking.project,
        name=config.tracking.run_name or run,
        config=config.model_dump(mode="json", by_alias=True),
    )
    trackers = []
    for name in config.tracking.report_to:
        cls = TRACKERS[name]
        if not cls.installed():
            log.warning("proxy.tracker_missing", tracker=name, fix=install_hint(name))
            metrics.errors.labels(name).inc()
            continue
        trackers.append(cls(target))
    return trackers


def start_forwarding(
    config: RunConfig,
    run: str,
    *,
    redis: Redis,
    bucket: Bucket,
    registry: CollectorRegistry,
    keep_going: Callable[[], bool] = lambda: True,
    on_progress: Callable[[], object] = lambda: None,
    trackers: list[Tracker] | None = None,
    poll_s: float = POLL_S,
) -> Forwarder:
    """Start one follower per tracker of ``tracking.report_to`` (``trackers``: these instead, for tests);
    ``on_progress``: called after each record marked sent (the server marks a snapshot change)."""
    metrics = TrackerMetrics(registry)
    if trackers is None:
        trackers = build_trackers(config, run, metrics)
    followers = [
        TrackerFollower(
            tracker,
            redis=redis,
            bucket=bucket,
            run=run,
            metrics=metrics,
            keep_going=keep_going,
            on_progress=on_progress,
            poll_s=poll_s,
        )
        for tracker in trackers
    ]
    if followers:
        log.info("proxy.tracking_started", trackers=[tracker.name for tracker in trackers])
    return Forwarder(followers).start()
