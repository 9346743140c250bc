"""The wandb and mlflow adapters against the real libraries, offline: the forwarder's threads (real Redis, a
file:// bucket) send steps and eval results, a restarted forwarder resumes the same tracker run, and what the
library stored is read back (wandb: its offline run log; mlflow: ``MlflowClient`` over a local file store).

Not shown here, since no offline library can: wandb or mlflow refusing a call (a wrong key, a server down),
which tests/e2e/test_e2e_tracking.py shows with a wandb stand-in that raises, and
tests/integration/test_tracking.py with adapters that raise; and a library not installed (also there)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.run.config import RunConfig, TrackingConfig
from proxy.coordinator.redis_store import RunKeys
from proxy.tracking.forwarder import Forwarder, start_forwarding
from proxy.tracking.trackers import RUN_TAG, MlflowTracker, WandbTracker, flat_params
from tests.support.tracker_doubles import RUN, publish_step, put_eval, wait_until, wandb_offline_runs

# The dev extra installs both; found, not imported, here: their imports take seconds, paid only by the tests.
pytestmark = pytest.mark.skipif(
    not (WandbTracker.installed() and MlflowTracker.installed()), reason="pip install -e '.[dev]' (wandb, mlflow)"
)


@pytest.fixture
def bucket(tmp_path: Path) -> Bucket:
    return open_bucket(f"file://{tmp_path / 'bucket'}")


def _forward_two_sessions(tracker: str, config: RunConfig, redis_client: redis.Redis, bucket: Bucket) -> None:
    """Session 1 sends steps 1-3, then the evals of versions 0 and 2 (both at once, after step 3), then step 4;
    a restarted proxy's session 2 sends step 5. The tracker refused nothing."""
    keys = RunKeys(RUN)

    def cursor() -> int:
        return int(redis_client.hget(keys.tracking, f"{tracker}:step") or 0)

    def stop(forwarder: Forwarder) -> None:
        # The tracker's run is finished (its offline log complete) before anything reads it: a loaded machine
        # can take longer than the default stop timeout, which only bounds a proxy's shutdown.
        forwarder.stop()
        wait_until(lambda: not any(f.alive() for f in forwarder.followers), "the tracker run to finish")

    def start() -> tuple[CollectorRegistry, Forwarder]:
        registry = CollectorRegistry()
        return registry, start_forwarding(
            config, RUN, redis=redis_client, bucket=bucket, registry=registry, poll_s=0.05
        )

    publish_step(redis_client, bucket, 1, 2, 3)
    put_eval(bucket, 0, {"pass@1": 0.125, "reward": 0.125})
    put_eval(bucket, 2, {"pass@1": 0.5, "reward": 0.5})
    registry, forwarder = start()
    wait_until(lambda: redis_client.hexists(keys.tracking, f"{tracker}:eval:2"), "steps 1-3 and both evals sent")
    publish_step(redis_client, bucket, 4)
    wait_until(lambda: cursor() == 4, "step 4 sent")
    stop(forwarder)
    publish_step(redis_client, bucket, 5)
    registry, forwarder = start()
    wait_until(lambda: cursor() == 5, "step 5 sent by the restarted forwarder")
    stop(forwarder)
    assert registry.get_sample_value("asyncgrpo_tracker_errors_total", {"tracker": tracker}) == 0


def _config(tracker: str) -> RunConfig:
    return RunConfig(tracking=TrackingConfig(report_to=[tracker], project=f"test-{uuid.uuid4().hex[:8]}"))


@pytest.mark.processes
def test_wandb_offline_gets_every_step_and_eval_against_its_version_and_resumes_its_run(
    redis_client: redis.Redis, bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: the run's log stays in WANDB_DIR
    monkeypatch.setenv("WANDB_SILENT", "true")
    for folder in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(folder, str(wandb_dir))  # nothing written under the home directory
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = _config("wandb")
    _forward_two_sessions("wandb", config, redis_client, bucket)

    first, resumed = wandb_offline_runs(wandb_dir)
    assert first.run_id == resumed.run_id == RUN  # the restarted proxy went on with the run's id
    dumped = config.model_dump(mode="json", by_alias=True)
    for run in (first, resumed):
        assert {key: run.config[key] for key in ("optimizer", "tracking", "seed")} == {
            key: dumped[key] for key in ("optimizer", "tracking", "seed")
        }
        # Every metric is plotted against train/global_step, as transformers' WandbCallback defines it.
        assert {"name": "train/global_step", "options": {"defined": True}} in run.metrics
        assert any(m.get("glob_name") == "*" and m.get("step_metric") == "train/global_step" for m in run.metrics)
        assert "output_raw" not in run.record_kinds and "output" not in run.record_kinds  # not the proxy's logs
    rows = first.history + resumed.history
    train = [
        (row["train/global_step"], row["reward"], row["clip_ratio/region_mean"]) for row in rows if "reward" in row
    ]
    assert train == [(step, 0.25 * step, 0.02) for step in (1, 2, 3, 4, 5)]  # step 4 too, after two evals
    evals = [(row["train/global_step"], row["eval/pass@1"], row["eval/reward"]) for row in rows if "eval/pass@1" in row]
    assert evals == [(0, 0.125, 0.125), (2, 0.5, 0.5)]


def test_mlflow_gets_every_step_and_eval_at_its_version_the_config_as_params_and_resumes_its_run(
    redis_client: redis.Redis, bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mlflow 3 keeps the file store only on request (its default is a database, which mlflow-skinny lacks).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient
    from mlflow.artifacts import load_dict

    config = _config("mlflow")
    _forward_two_sessions("mlflow", config, redis_client, bucket)

    client = MlflowClient()
    experiment = client.get_experiment_by_name(config.tracking.project)
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "the restarted forwarder resumed the run rather than starting another"
    run = runs[0]
    assert run.data.tags[RUN_TAG] == RUN and run.info.run_name == RUN
    assert run.data.params == flat_params(config.model_dump(mode="json", by_alias=True))
    assert load_dict(f"{run.info.artifact_uri}/run_config.json") == config.model_dump(mode="json", by_alias=True)

    def history(name: str) -> list[tuple[int, float]]:
        return sorted((metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, name))

    assert history("reward") == [(step, 0.25 * step) for step in (1, 2, 3, 4, 5)]
    assert history("clip_ratio/region_mean") == [(step, 0.02) for step in (1, 2, 3, 4, 5)]
    assert history("rewards/repeat_digit/mean") == [(step, 0.25 * step) for step in (1, 2, 3, 4, 5)]
    assert history("eval/pass_1") == [(0, 0.125), (2, 0.5)]  # mlflow refuses '@' in a name
    assert history("eval/reward") == [(0, 0.125), (2, 0.5)]


def test_mlflow_params_are_the_config_flattened_to_dotted_names() -> None:
    assert flat_params({"a": {"b": {"c": 1}}, "d": None, "e": [1, 2]}) == {"a.b.c": "1", "d": "None", "e": "[1, 2]"}
