"""Evaluation during training end to end (``[eval]``): real proxy, real generate and optimize workers on the tiny
model, a real bucket. A short run (4 steps) with ``every_versions = 2`` writes eval records for exactly the
versions 0, 2 and 4; the newest shows on the proxy's ``/metrics``, in ``asyncgrpo status`` and in
``asyncgrpo plot``, no eval completion reaches a step, and every eval task ends on its worker as recorded,
none reported as failed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.protocol.client import ProxyClient
from cli.history import load_eval_records, load_step_records
from cli.local_cluster import LocalCluster, free_port
from cli.plot import EVAL_PANEL_TITLE, draw_records, plot_run
from cli.status import collect_status, render_status
from tests.support.e2e_harness import assert_run_invariants, metric_value, records_of, scrape, wait_for
from tests.support.fixtures_s3 import open_env_bucket

pytestmark = pytest.mark.slow

EVAL_TOML = """
[eval]
every_versions = 2
samples_per_prompt = 2
temperature = 1.0
max_prompts_per_task = 3

[eval.dataset]
generator = "repeat_digit"
num_prompts = 5
"""


def test_eval_records_for_due_versions_reach_metrics_status_and_plot(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = make_cluster(total_steps=4, extra_toml=EVAL_TOML)
    cluster.start_worker("optimize", name="opt-1")
    ports = [free_port(), free_port()]
    for index, port in enumerate(ports, start=1):
        cluster.start_worker("generate", name=f"gen-{index}", env={"ASYNCGRPO_METRICS_PORT": str(port)})
    bucket = open_env_bucket(cluster.bucket_url)

    def evaluated() -> bool:
        status = cluster.status()
        return status["current_version"] == 4 and status["evals_pending"] == 0 and status["eval_latest"] is not None

    wait_for(evaluated, 300, "version 4 and its evaluation", cluster)
    evals = load_eval_records(bucket, cluster.run)
    assert [record.version for record in evals] == [0, 2, 4]
    for record in evals:
        assert record.prompts == 5 and record.samples_per_prompt == 2
        assert {"reward", "reward_std", "rewards/repeat_digit/mean", "pass@1", "pass@2"} <= set(record.metrics)
        assert 0.0 <= record.metrics["pass@1"] <= record.metrics["pass@2"] <= 1.0
        assert record.examples and record.examples[0].prompt.endswith("=")
    status = cluster.status()
    assert status["counters"]["eval_versions_done"] == 3 and status["counters"]["eval_tasks_done"] == 6  # 2 chunks
    assert status["eval_latest"]["version"] == 4

    # On the workers: the six tasks ended as recorded, each counted once, and none was reported as failed (its
    # result stored, then the task line's log call raised: the proxy was told the task failed and sent it again).
    def outcomes() -> dict[str, float]:
        scrapes = [scrape(port) for port in ports]
        name = "asyncgrpo_eval_tasks_total"
        return {
            status: sum(metric_value(text, f'{name}{{status="{status}"}}') for text in scrapes)
            for status in ("recorded", "failed")
        }

    def all_ended() -> dict[str, float] | None:
        counted = outcomes()
        return counted if sum(counted.values()) >= 6 else None

    ended = wait_for(all_ended, 30, "six eval tasks ended on the workers", cluster)
    assert ended == {"recorded": 6, "failed": 0}, ended
    assert status["eval_latest"]["metrics"]["reward"] == pytest.approx(evals[-1].metrics["reward"])

    # Evaluation never feeds a gradient: the steps trained only generate rollouts.
    records = records_of(cluster)
    assert_run_invariants(records)
    assert all(not rollout.task_id.startswith("eval-") for r in records for rollout in r.rollouts)
    kept = {key.rsplit("/", 1)[1] for key in bucket.list(bucket_keys.rollouts_prefix(cluster.run))}
    assert not any(name.startswith("eval-") for name in kept)

    proxy_metrics = httpx.get(f"{cluster.proxy_url}/metrics", timeout=5).text
    assert metric_value(proxy_metrics, "asyncgrpo_eval_version") == 4
    assert metric_value(proxy_metrics, "asyncgrpo_evals_pending") == 0
    assert 'asyncgrpo_eval_reward{reward="total"}' in proxy_metrics
    assert 'asyncgrpo_eval_pass_at_k{k="2"}' in proxy_metrics

    with ProxyClient(cluster.proxy_url, cluster.token) as client:
        snapshot = collect_status(client, bucket)
    console = Console(width=200, record=True)
    console.print(render_status(snapshot))
    assert "v4: reward" in console.export_text()

    figure = draw_records(load_step_records(bucket, cluster.run), evals=evals)
    assert EVAL_PANEL_TITLE in [ax.get_title() for ax in figure.axes] and len(figure.axes) == 5
    out = plot_run(bucket, cluster.run, tmp_path / "run.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
