"""``asyncgrpo status``: a real coordinator behind a real HTTP server, read with ProxyClient and the bucket."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from redis import Redis
from rich.console import Console

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.records import StepRecord, StepTimings
from asyncgrpo.protocol.schemas import FleetView, HeartbeatRequest
from asyncgrpo.run.creation import create_run
from cli.main import main
from cli.status import collect_status, render_status, show_status, sparkline
from proxy.api.app import create_app
from proxy.coordinator.service import Coordinator
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.fixtures_redis import free_port
from tests.support.proxy_harness import ManualClock, advance_version, make_coordinator, small_config

RUN = "r1"
CONFIG_TOML = """
[dataset]
generator = "repeat_digit"
num_prompts = 20
[async]
groups_per_task = 2
groups_per_step = 4
queue_maxsize = 8
max_staleness = 1
"""


@pytest.fixture
def run_bucket(tmp_path: Path) -> Bucket:
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    config_path = tmp_path / "run.toml"
    config_path.write_text(CONFIG_TOML)
    create_run(config_path, RUN, bucket)
    return bucket


@pytest.fixture
def coordinator(redis_client: Redis, run_bucket: Bucket) -> Coordinator:
    # The clock starts a minute ago so that heartbeat ages read naturally against the wall clock.
    clock = ManualClock(start_ms=int(time.time() * 1000) - 60_000)
    coord = make_coordinator(redis_client, run_bucket, run=RUN, config=small_config(), clock=clock)
    coord.heartbeat(_beat("gen-old", "generate"))
    submitted: set[str] = set()
    for _ in range(3):  # v0 (init) and two trained versions
        advance_version(coord, submitted)
    clock.advance(60)
    coord.heartbeat(_beat("gen-a", "generate", versions=[1, 2], task="task-7"))
    coord.heartbeat(_beat("trainer-1", "optimize"))
    coord.tick()
    for step in (1, 2):
        run_bucket.put(bucket_keys.metrics_key(RUN, step), _step_record(step).model_dump_json().encode())
    return coord


def _step_record(step: int) -> StepRecord:
    """A step record with the figures the view draws; the rest empty."""
    return StepRecord(
        run=RUN,
        step=step,
        version=step,
        base_version=step - 1,
        worker_id="trainer-1",
        published_at=time.time() - 10 * (3 - step),
        samples=8,
        groups=2,
        tokens=48,
        reward_mean=0.25 * step,
        reward_std=0.1,
        rewards_by_name={},
        rewards_std_by_name={},
        completion_length_mean=5.0 + step,
        truncated_fraction=0.0,
        staleness=[step - 1],
        max_staleness=step - 1,
        ratio=1.0,
        rescore_ratio=1.0,
        kl=0.001 * step,
        entropy=None,
        clip_low=None,
        clip_high=None,
        clip_region=None,
        loss=None,
        grad_norm=None,
        lr=None,
        updates=[],
        rollouts=[],
        flagged_rollouts=[],
        timings=StepTimings(step_s=1.5),
    )


def _beat(worker_id: str, role: str, versions: list[int] | None = None, task: str | None = None) -> HeartbeatRequest:
    return HeartbeatRequest(
        worker_id=worker_id,
        role=role,
        hostname="host-1",
        pid=4242,
        state="busy" if task else "idle",
        versions_cached=versions or [],
        current_task=task,
    )


@pytest.fixture
def proxy_url(coordinator: Coordinator) -> Iterator[str]:
    """The proxy's real app on a real port (no housekeeping loop: the test drives the coordinator)."""
    with served(create_app(coordinator, API_TOKEN, run_loop=False)) as url:
        yield url


def _text(renderable) -> str:
    console = Console(file=io.StringIO(), width=160, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_status_shows_version_buffer_trend_and_workers(proxy_url: str, run_bucket: Bucket) -> None:
    with ProxyClient(proxy_url, API_TOKEN) as client:
        snapshot = collect_status(client, run_bucket)
    assert snapshot.status.current_version == 2
    assert snapshot.config is not None and snapshot.config.async_.queue_maxsize == 8
    assert [r.step for r in snapshot.records] == [1, 2]

    text = _text(render_status(snapshot))
    assert "run r1" in text and "v2" in text
    assert f"{snapshot.status.groups_buffered} admitted" in text and "/ 8" in text
    assert "max staleness (limit 1)" in text
    assert "reward mean" in text and "0.25" in text and "0.5" in text
    rows = [[cell.strip() for cell in line.split("│") if cell.strip()] for line in text.splitlines() if "│" in line]
    lines = {row[0]: " ".join(row) for row in rows if row and row[0].startswith(("gen-", "trainer-"))}
    assert set(lines) == {"gen-old", "gen-a", "trainer-1"}
    dead_age = re.search(r"(\d+)s ago \(dead\)", lines["gen-old"])
    assert dead_age is not None and 60 <= int(dead_age.group(1)) < 90, lines["gen-old"]
    assert "(dead)" not in lines["gen-a"] and "v1,v2" in lines["gen-a"] and "task-7" in lines["gen-a"]
    assert "generate: 1" in text and "optimize: 1" in text
    assert "generators wanted" not in text, "two steps are too few to measure: no figure rather than a guess"

    snapshot.status.fleet = FleetView(wanted=5, submitting=3, step_s=2.0, task_s=3.75, tasks_per_version=2)
    text = _text(render_status(snapshot))
    assert "generators wanted" in text and "5 (3 submitting; 2 tasks per version, task 3.75 s, step 2.00 s)" in text


def test_status_without_bucket_and_in_watch_mode(proxy_url: str) -> None:
    output = io.StringIO()
    console = Console(file=output, width=160, color_system=None, force_terminal=False)
    with ProxyClient(proxy_url, API_TOKEN) as client:
        show_status(client, None, watch=True, interval_s=0.01, console=console, max_refreshes=2)
    text = output.getvalue()
    assert "run r1" in text and "no step records yet" in text


def test_status_command(proxy_url: str, run_bucket: Bucket) -> None:
    command = ["status", "--proxy", proxy_url, "--token", API_TOKEN, "--bucket", run_bucket.url]
    answer = CliRunner().invoke(main, command)
    assert answer.exit_code == 0, answer.output
    assert "run r1" in answer.output and "trainer-1" in answer.output

    closed = f"http://127.0.0.1:{free_port()}"
    answer = CliRunner().invoke(main, ["status", "--proxy", closed])
    assert answer.exit_code == 1
    assert f"cannot read the proxy at {closed}" in answer.output


def test_sparkline_scales_between_min_and_max() -> None:
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▅▅"
    assert sparkline([]) == ""
