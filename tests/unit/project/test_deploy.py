"""deploy/: systemd units, env example, Prometheus config and rules, Grafana dashboard, Procfile.

The dashboard and the alert rules may only name metrics that the code exports: the names are collected from
the real registries (the proxy's ``ProxyMetrics`` and the workers' ``worker_metrics.REGISTRY``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest

from asyncgrpo.protocol import log_setup
from asyncgrpo.protocol.schemas import FleetView, LeaseRecord, StatusResponse
from asyncgrpo.protocol.settings import env_name, variables
from cli.main import main as cli_main
from proxy.api.settings import ProxySettings
from proxy.coordinator.metrics import ProxyMetrics, RunLimits
from tests.support.paths import PACKAGES, REPO_ROOT
from worker.process import metrics as worker_metrics
from worker.process.settings import WorkerSettings

ROOT = REPO_ROOT
DEPLOY = ROOT / "deploy"
UNITS = DEPLOY / "systemd"
ENV_EXAMPLE = DEPLOY / "asyncgrpo.env.example"
RULES = DEPLOY / "prometheus" / "asyncgrpo-alerts.yml"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
AUTOSCALE = DEPLOY / "autoscale"
KEDA = AUTOSCALE / "keda-scaledobject.yaml"
DASHBOARD = DEPLOY / "grafana" / "asyncgrpo-dashboard.json"
ENV_NAME = re.compile(r"\bASYNCGRPO_[A-Z0-9_]+\b")
METRIC_NAME = re.compile(r"\basyncgrpo_[a-z0-9_]+\b")
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "_info")
# Margin between the soft shutdown and systemd's SIGKILL: Celery's own shutdown plus the broker handback.
STOP_MARGIN_S = 10


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections of a systemd unit as (key, value) lists (systemd allows repeated keys)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        assert current is not None and "=" in line, f"{path.name}: cannot parse {raw!r}"
        key, value = line.split("=", 1)
        sections[current].append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", value)
    assert match, f"cannot read a duration from {value!r}"
    number = float(match.group(1))
    return number * 60 if match.group(2) in ("min", "m") else number


def default_soft_shutdown_s(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.delenv("ASYNCGRPO_SOFT_SHUTDOWN_S", raising=False)
    return WorkerSettings().soft_shutdown_s


@pytest.mark.parametrize(
    "name", ["asyncgrpo-proxy.service", "asyncgrpo-generate@.service", "asyncgrpo-optimize.service"]
)
def test_units_restart_stop_and_read_the_env_file(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    unit = parse_unit(UNITS / name)
    service = "Service"
    assert values(unit, service, "Restart") == ["on-failure"]
    assert values(unit, service, "KillMode") == ["mixed"]
    assert values(unit, service, "EnvironmentFile") == ["/etc/asyncgrpo/asyncgrpo.env"]
    assert len(values(unit, service, "ExecStart")) == 1
    (stop,) = values(unit, service, "TimeoutStopSec")
    if "proxy" not in name:
        # The stop timeout must leave the soft shutdown its full time, or systemd kills a task mid-handback.
        assert seconds(stop) >= default_soft_shutdown_s(monkeypatch) + STOP_MARGIN_S, stop
        assert "asyncgrpo worker " in values(unit, service, "ExecStart")[0]
        assert "ASYNCGRPO_METRICS_PORT=" in values(unit, service, "ExecStart")[0]
    assert values(unit, "Install", "WantedBy") == ["multi-user.target"]


def test_generate_instances_get_their_gpu_and_their_own_metrics_port() -> None:
    unit = parse_unit(UNITS / "asyncgrpo-generate@.service")
    env = values(unit, "Service", "Environment")
    assert "CUDA_VISIBLE_DEVICES=%i" in env
    assert any(item.startswith("ASYNCGRPO_WORKER_ID=") and "%i" in item for item in env)
    (exec_start,) = values(unit, "Service", "ExecStart")
    # The port is computed per instance by the shell, and the shell is replaced by the worker (exec).
    assert re.search(r"ASYNCGRPO_METRICS_PORT=\$\$\(\(.*\+ %i \)\)", exec_start), exec_start
    assert " exec " in exec_start


@pytest.mark.processes
def test_systemd_analyze_accepts_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # systemd-analyze checks that ExecStart binaries exist: point them at a real executable here.
    stand_in = shutil.which("true") or "/bin/true"
    for unit in [*UNITS.glob("*.service"), *AUTOSCALE.glob("*.service")]:
        text = unit.read_text().replace("/opt/asyncgrpo/venv/bin/asyncgrpo", stand_in)
        target = tmp_path / unit.name.replace("@.service", "@0.service")
        target.write_text(text)
    names = sorted(str(p) for p in tmp_path.glob("*.service"))
    check = subprocess.run([analyze, "verify", "--man=no", *names], capture_output=True, text=True, timeout=60)
    complaints = [line for line in check.stderr.splitlines() if "asyncgrpo" in line]
    if check.returncode != 0 and not complaints:
        pytest.skip(f"systemd-analyze cannot run here: {check.stderr.strip()[:200]}")
    assert check.returncode == 0 and not complaints, check.stderr


def test_the_scaler_unit_runs_the_scaler_with_options_it_accepts() -> None:
    unit = parse_unit(AUTOSCALE / "asyncgrpo-scale-generate.service")
    assert values(unit, "Service", "EnvironmentFile") == ["/etc/asyncgrpo/asyncgrpo.env"]
    assert values(unit, "Service", "Restart") == ["always"]
    assert values(unit, "Service", "KillMode") == ["process"], "stopping the scaler must not stop the workers"
    (exec_start,) = values(unit, "Service", "ExecStart")
    binary, *args = exec_start.split()
    assert binary == "/opt/asyncgrpo/venv/bin/asyncgrpo" and args[0] == "scale-generate"
    # The flags exist (an unknown one fails at parsing, before --help stops the command from running).
    answer = CliRunner().invoke(cli_main, [*args, "--help"])
    assert answer.exit_code == 0, answer.output


def test_the_keda_object_scales_on_the_wanted_gauge_one_pod_per_worker() -> None:
    yaml = pytest.importorskip("yaml")
    scaled = yaml.safe_load(KEDA.read_text())
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    spec = scaled["spec"]
    assert spec["minReplicaCount"] >= 1, "a fleet scaled to zero is never measured again"
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["threshold"] == "1", "AverageValue with threshold 1: replicas = the wanted count"
    assert meta["ignoreNullValues"] == "false", "no series must hold the pods, not scale them to the minimum"
    assert METRIC_NAME.findall(meta["query"]) == ["asyncgrpo_generate_workers_wanted"]
    assert "asyncgrpo_generate_workers_wanted" in exported_names()
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60


def documented_env_vars() -> dict[str, str]:
    """Variable name -> the comment block just above it in the env example (commented-out lines count)."""
    documented: dict[str, str] = {}
    comment: list[str] = []
    for raw in ENV_EXAMPLE.read_text().splitlines():
        line = raw.strip()
        match = re.match(r"^#?(ASYNCGRPO_[A-Z0-9_]+)=", line)
        if match:
            documented[match.group(1)] = " ".join(comment)
            comment = []
        elif line.startswith("#"):
            comment.append(line.lstrip("# "))
        else:
            comment = []
    return documented


def settings_env_vars() -> set[str]:
    """Every variable a process reads: the settings classes' fields (the only code that reads the environment),
    every name spelled out in the packages (error messages, CLI envvars), and those the units use."""
    names = {name for cls in (ProxySettings, WorkerSettings) for name in variables(cls)}
    for module in sorted(path for top in PACKAGES for path in (ROOT / top).rglob("*.py")):
        names |= set(ENV_NAME.findall(module.read_text()))
    names |= {log_setup.LOG_FORMAT_ENV, log_setup.LOG_LEVEL_ENV}
    return names | unit_env_vars()


def unit_env_vars() -> set[str]:
    return {name for unit in UNITS.glob("*.service") for name in ENV_NAME.findall(unit.read_text())}


def former_env_vars() -> set[str]:
    """The variables a renamed setting still reads under its former name (its ``AliasChoices``)."""
    read = {name for cls in (ProxySettings, WorkerSettings) for name in variables(cls)}
    return read - {env_name(field) for cls in (ProxySettings, WorkerSettings) for field in cls.model_fields}


def test_env_example_documents_every_variable() -> None:
    """Every variable under its current name; a former name is read, not advertised."""
    documented = documented_env_vars()
    missing = sorted(settings_env_vars() - former_env_vars() - set(documented))
    assert not missing, f"add these to {ENV_EXAMPLE.relative_to(ROOT)} with a comment: {missing}"
    uncommented = sorted(name for name, comment in documented.items() if len(comment) < 10)
    assert not uncommented, f"give these a comment line above them in the env example: {uncommented}"


def test_env_example_names_no_unknown_variable() -> None:
    """A variable in the example is a setting or one the units read: a misspelt name would be ignored."""
    unknown = sorted(set(documented_env_vars()) - settings_env_vars())
    assert not unknown, f"{ENV_EXAMPLE.relative_to(ROOT)} names variables nothing reads: {unknown}"


def test_env_example_values_are_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every value the example sets or shows (commented defaults too) passes the settings classes' checks."""
    for raw in ENV_EXAMPLE.read_text().splitlines():
        match = re.match(r"^#?(ASYNCGRPO_[A-Z0-9_]+)=(.*)$", raw.strip())
        if match:
            monkeypatch.setenv(match.group(1), match.group(2))
    ProxySettings()
    WorkerSettings()


def test_procfile_starts_every_process_with_real_commands() -> None:
    lines = [line for line in (ROOT / "Procfile").read_text().splitlines() if line and not line.startswith("#")]
    processes = dict(line.split(":", 1) for line in lines)
    assert {"proxy", "generate", "optimize"} <= set(processes)
    commands = set(cli_main.commands)
    for name in ("proxy", "generate", "optimize"):
        words = processes[name].split()
        subcommand = words[words.index("asyncgrpo") + 1]
        assert subcommand in commands, f"Procfile {name}: 'asyncgrpo {subcommand}' is not a CLI command"
    ports = [re.search(r"ASYNCGRPO_METRICS_PORT=(\d+)", processes[name]).group(1) for name in ("generate", "optimize")]
    assert len(set(ports)) == 2, "each worker process needs its own metrics port"


# ---- metric names --------------------------------------------------------------------------------------


def _proxy_metrics() -> ProxyMetrics:
    metrics = ProxyMetrics()
    status = StatusResponse(
        run="r1",
        current_version=3,
        final_version=10,
        finished=False,
        step_inflight=4,
        epoch=0,
        epoch_pos=8,
        groups_buffered=2,
        groups_inflight=4,
        groups_requeued=0,
        tasks_inflight=2,
        counters={"publish": 3},
        rejected_by_reason={"too long": 1},
        leases=[LeaseRecord(lease_id="l1", version=3, worker_id="w1", task_id="t1", expires_at=0.0)],
        workers_alive_by_role={"generate": 2, "optimize": 1},
    )
    metrics.watch_state(lambda: status, RunLimits(max_staleness_versions=2, queue_maxsize_groups=16, groups_per_step=8))
    fleet = FleetView(wanted=5, submitting=3, step_s=2.0, task_s=4.0, tasks_per_version=2)
    metrics.watch_fleet(lambda: fleet)
    metrics.sample_staleness.observe(1)
    metrics.http_seconds.labels("/v1/status", "GET").observe(0.01)
    return metrics


def exported_names() -> set[str]:
    """Every family and sample name the proxy and worker registries expose."""
    names: set[str] = set()
    for registry in (_proxy_metrics().registry, worker_metrics.REGISTRY):
        for family in registry.collect():
            names.add(family.name)
            if family.type in ("counter", "info"):
                names.add(family.name + ("_total" if family.type == "counter" else "_info"))
            if family.type == "histogram":
                names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
            names.update(sample.name for sample in family.samples)
    return names


def rule_expressions() -> list[str]:
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in data["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in data["panels"]:
        exprs.extend(target["expr"] for target in panel.get("targets", []))
    return exprs


def test_metric_name_collection_sees_both_registries() -> None:
    names = exported_names()
    assert {
        "asyncgrpo_current_version",
        "asyncgrpo_stale_drops_total",
        "asyncgrpo_sample_staleness_versions_bucket",
        "asyncgrpo_trainer_rollout_wait_seconds_sum",
        "asyncgrpo_generate_backpressure_seconds_sum",
        "asyncgrpo_worker_info",
    } <= names
    assert "asyncgrpo_no_such_metric" not in names


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_queries_name_only_exported_metrics(source: str) -> None:
    expressions = rule_expressions() if source == "rules" else dashboard_expressions()
    referenced = {name for expr in expressions for name in METRIC_NAME.findall(expr)}
    assert len(referenced) >= 10, f"the {source} should cover the run, found only {sorted(referenced)}"
    unknown = sorted(referenced - exported_names())
    assert not unknown, f"the {source} query metrics nobody exports: {unknown}"


def test_dashboard_covers_both_sides_and_the_bottleneck_pair() -> None:
    data = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in data["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    text = " ".join(dashboard_expressions())
    for needed in (
        "asyncgrpo_generate_tokens_total",
        "asyncgrpo_trainer_tokens_total",  # throughput on both sides
        "asyncgrpo_trainer_rollout_wait_seconds_sum",
        "asyncgrpo_generate_backpressure_seconds_sum",  # bottleneck
        "asyncgrpo_groups_buffered",
        "asyncgrpo_sample_staleness_versions_bucket",
        "asyncgrpo_current_version",
        "asyncgrpo_trainer_publish_seconds_bucket",
        "asyncgrpo_policy_reward_mean",
        "asyncgrpo_policy_ratio",
        "asyncgrpo_workers_alive",
        "asyncgrpo_generate_workers_wanted",  # the autoscaling signal beside the fleet
    ):
        assert needed in text, f"the dashboard has no panel for {needed}"


def test_alert_rules_cover_the_issue_list() -> None:
    yaml = pytest.importorskip("yaml")
    alerts = {
        rule["alert"]: rule
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    for name in (
        "AsyncgrpoNoNewVersion",
        "AsyncgrpoTrainerStarved",
        "AsyncgrpoStalenessNearMax",
        "AsyncgrpoStaleDropsRising",
        "AsyncgrpoNoGenerateWorker",
        "AsyncgrpoLeaseExpiriesSpiking",
        "AsyncgrpoRatioDrift",
        "AsyncgrpoRunHalted",
        "AsyncgrpoGenerateFleetShort",
    ):
        assert name in alerts, f"missing alert {name}"
        assert alerts[name]["annotations"]["summary"] and alerts[name]["labels"]["severity"]


# ---- promtool ------------------------------------------------------------------------------------------


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return path


def test_promtool_accepts_rules_and_scrape_config() -> None:
    tool = promtool()
    for args in (["check", "rules", str(RULES)], ["check", "config", str(SCRAPE_CONFIG)]):
        check = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("side", ["proxy", "worker"])
def test_promtool_accepts_each_metrics_endpoint(side: str) -> None:
    tool = promtool()
    registry = _proxy_metrics().registry if side == "proxy" else worker_metrics.REGISTRY
    text = generate_latest(registry).decode()
    check = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def _rule_test(tmp_path: Path, name: str, tests: list[dict[str, object]]) -> None:
    """``promtool test rules`` on the real rule file with ``tests`` (input series, alert and expression checks)."""
    yaml = pytest.importorskip("yaml")
    tool = promtool()
    spec = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests}
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(spec))
    check = subprocess.run([tool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def _fleet_series(starved_per_min: float, wanted: int, submitting: int) -> list[dict[str, str]]:
    job = '{job="asyncgrpo-proxy",instance="p:8700"}'
    return [
        # Seconds starved per minute, as the proxy's counter grows.
        {"series": f"asyncgrpo_trainer_starved_seconds_total{job}", "values": f"0+{starved_per_min}x40"},
        {"series": f"asyncgrpo_generate_workers_wanted{job}", "values": f"{wanted}x40"},
        {"series": f"asyncgrpo_generate_workers_submitting{job}", "values": f"{submitting}x40"},
    ]


def test_the_fleet_short_alert_needs_both_starvation_and_a_short_fleet(tmp_path: Path) -> None:
    fires = {
        "exp_labels": {"severity": "warning"},
        "exp_annotations": {
            "summary": "the trainer starves and the fleet is short of the generate workers it needs",
            "description": "Wanted 6 generate workers; check the autoscaler's events, GPU quota and spot capacity.",
        },
    }

    def case(starved: float, wanted: int, submitting: int, at: str, expected: list[dict[str, object]]) -> dict:
        return {
            "interval": "1m",
            "input_series": _fleet_series(starved, wanted, submitting),
            "alert_rule_test": [{"eval_time": at, "alertname": "AsyncgrpoGenerateFleetShort", "exp_alerts": expected}],
        }

    _rule_test(
        tmp_path,
        "fleet_short",
        [
            case(30, 6, 2, "20m", [fires]),  # starved half the time, 4 workers short, for over 10 minutes
            case(30, 6, 2, "12m", []),  # not yet for 10 minutes (the rate needs its window first)
            case(30, 6, 6, "20m", []),  # starved, but the fleet is what the proxy wants: not the autoscaler
            case(3, 6, 2, "20m", []),  # short, but the trainer starves 5 % of the time: the buffer absorbs it
        ],
    )


def test_the_keda_query_reads_the_wanted_count(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    query = yaml.safe_load(KEDA.read_text())["spec"]["triggers"][0]["metadata"]["query"]
    _rule_test(
        tmp_path,
        "keda_query",
        [
            {
                "interval": "1m",
                "input_series": _fleet_series(0, 7, 3),
                "promql_expr_test": [{"expr": query, "eval_time": "5m", "exp_samples": [{"labels": "{}", "value": 7}]}],
            }
        ],
    )
