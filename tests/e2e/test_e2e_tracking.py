"""A short run with real processes and ``[tracking] report_to = ["trackio", "wandb"]``: trackio (real, in a
temporary directory) receives every step record, while a wandb whose init always raises is counted on the
proxy's /metrics and retried, and the run still reaches its final version."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from cli.local_cluster import LocalCluster
from tests.support.e2e_harness import assert_run_invariants, metric_value, records_of, version_reached, wait_for
from tests.support.tracker_doubles import trackio_dir, trackio_logs, write_fake_wandb

pytestmark = pytest.mark.slow

STEPS = 4


def test_trackio_receives_every_step_of_a_short_run_beside_a_tracker_that_raises(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = f"e2e-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir()))
    fake = write_fake_wandb(tmp_path / "fake-libs")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")])))
    cluster = make_cluster(
        total_steps=STEPS,
        extra_toml=f'\n[tracking]\nreport_to = ["trackio", "wandb"]\nproject = "{project}"\n',
    )
    cluster.start_worker("optimize", name="opt-1")
    cluster.start_worker("generate", name="gen-1")
    wait_for(version_reached(cluster, STEPS), 240, f"version {STEPS}, the run's last", cluster)
    records = records_of(cluster)
    assert_run_invariants(records)

    def every_reward_in_trackio() -> bool:
        return [row["step"] for row in trackio_logs(project, cluster.run) if "reward" in row] == list(
            range(1, STEPS + 1)
        )

    wait_for(every_reward_in_trackio, 30, "trackio to hold every step's reward", cluster)
    rows = [row for row in trackio_logs(project, cluster.run) if "reward" in row]
    assert [row["reward"] for row in rows] == [record.reward_mean for record in records]
    assert [row["kl"] for row in rows] == [record.kl for record in records]

    metrics = httpx.get(f"{cluster.proxy_url}/metrics", timeout=5).text
    assert metric_value(metrics, 'asyncgrpo_tracker_errors_total{tracker="wandb"}') >= 1
    assert metric_value(metrics, 'asyncgrpo_tracker_errors_total{tracker="trackio"}') == 0
    assert metric_value(metrics, 'asyncgrpo_tracker_step{tracker="trackio"}') == STEPS
    # The whole log: the failures come early (then back off) and request lines would push them out of a tail.
    proxy_log = next(child for child in cluster.children if child.name == "proxy").log_path.read_text(errors="replace")
    assert "proxy.tracker_failed" in proxy_log and "fake wandb: init refused" in proxy_log
