"""The settings layer: one pydantic-settings class per role on a common base, the only code that reads the
environment; defaults as documented, and errors that name the variable and say what to set."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from asyncgrpo.bucket.backends import S3Bucket, open_bucket
from asyncgrpo.protocol.settings import CacheSettings, LogSettings, SettingsError, StorageSettings, env_name, variables
from cli.main import main as cli_main
from proxy.__main__ import main as proxy_main
from proxy.api.settings import ProxySettings
from tests.support.paths import PACKAGES, REPO_ROOT
from worker.process import launcher
from worker.process.settings import WorkerSettings

ROOT = REPO_ROOT
SETTINGS_MODULES = {
    "asyncgrpo/protocol/settings.py",
    "proxy/api/settings.py",
    "worker/process/settings.py",
    "worker/generate/settings.py",
}


@pytest.fixture(autouse=True)
def no_asyncgrpo_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without ASYNCGRPO_* variables (CI may set some)."""
    for name in list(os.environ):
        if name.startswith("ASYNCGRPO_"):
            monkeypatch.delenv(name)


def test_worker_defaults_are_the_documented_ones() -> None:
    settings = WorkerSettings()
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.proxy_url == "http://127.0.0.1:8700"
    assert settings.token is None and settings.token_value() is None
    assert settings.bucket == "file://work/bucket"
    assert settings.device == "auto"
    assert settings.generation_backend is None and settings.vllm_engine_args == {}
    assert settings.cache == Path.home() / ".cache" / "asyncgrpo"
    assert (settings.visibility_timeout_s, settings.restore_interval_s) == (1800.0, 2.0)
    assert (settings.soft_shutdown_s, settings.heartbeat_s) == (20.0, 5.0)
    assert settings.metrics_port is None and settings.worker_role is None
    assert settings.celery_loglevel == "INFO"
    assert settings.worker_id.endswith(f"-{os.getpid()}")


def test_proxy_defaults_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ProxySettings().bucket is None
    monkeypatch.setenv("ASYNCGRPO_PROXY_PORT", "8123")
    monkeypatch.setenv("ASYNCGRPO_TICK_S", "0.5")
    monkeypatch.setenv("ASYNCGRPO_BUCKET", "s3://b/p")
    settings = ProxySettings()
    assert (settings.proxy_port, settings.tick_s, settings.bucket) == (8123, 0.5, "s3://b/p")


def test_the_leadership_ttl_reads_its_variable_and_its_former_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ASYNCGRPO_PROXY_LEASE_TTL_S`` was the variable's name before "lease" was kept for the workers' leases."""
    assert ProxySettings().proxy_leadership_ttl_s == 6.0
    monkeypatch.setenv("ASYNCGRPO_PROXY_LEASE_TTL_S", "9")
    assert ProxySettings().proxy_leadership_ttl_s == 9.0
    monkeypatch.setenv("ASYNCGRPO_PROXY_LEADERSHIP_TTL_S", "7")
    assert ProxySettings().proxy_leadership_ttl_s == 7.0, "the current name wins over the former one"
    monkeypatch.delenv("ASYNCGRPO_PROXY_LEASE_TTL_S")
    monkeypatch.setenv("PROXY_LEADERSHIP_TTL_S", "8")  # unprefixed: not a variable of ours
    assert ProxySettings().proxy_leadership_ttl_s == 7.0
    assert {"ASYNCGRPO_PROXY_LEADERSHIP_TTL_S", "ASYNCGRPO_PROXY_LEASE_TTL_S"} <= set(variables(ProxySettings))


@pytest.mark.parametrize("variable", ["ASYNCGRPO_PROXY_LEADERSHIP_TTL_S", "ASYNCGRPO_PROXY_LEASE_TTL_S"])
def test_a_bad_value_of_a_renamed_setting_names_its_variable(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """pydantic reports an aliased field under its first alias: the current name, whichever of the two was set."""
    monkeypatch.setenv(variable, "0.5")
    with pytest.raises(SettingsError) as caught:
        ProxySettings()
    message = str(caught.value)
    assert message.startswith("ASYNCGRPO_PROXY_LEADERSHIP_TTL_S='0.5' is invalid: ") and ">= 1.0, <= 600.0" in message
    assert "Set ASYNCGRPO_PROXY_LEADERSHIP_TTL_S (Seconds the proxy's leadership" in message


def test_every_field_has_a_docstring() -> None:
    for cls in (ProxySettings, WorkerSettings):
        for name, info in cls.model_fields.items():
            assert info.description and len(info.description) > 15, f"document {cls.__name__}.{name}"


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("ASYNCGRPO_HEARTBEAT_S", "soon", "valid number"),
        ("ASYNCGRPO_HEARTBEAT_S", "0", "greater than 0"),
        ("ASYNCGRPO_METRICS_PORT", "70000", "less than or equal to 65535"),
        ("ASYNCGRPO_DEVICE", "gpu", "String should match pattern"),
        ("ASYNCGRPO_REDIS_URL", "localhost:6379", "String should match pattern"),
        ("ASYNCGRPO_BUCKET", "/plain/path", "String should match pattern"),
        ("ASYNCGRPO_WORKER_ROLE", "trainer", "'generate' or 'optimize'"),
        ("ASYNCGRPO_GENERATION_BACKEND", "sglang", "'transformers' or 'vllm'"),
        ("ASYNCGRPO_VLLM_ENGINE_ARGS", "gpu_memory_utilization=0.8", "not valid JSON"),
        ("ASYNCGRPO_VLLM_ENGINE_ARGS", "[0.8]", "JSON object"),
        ("ASYNCGRPO_CELERY_LOGLEVEL", "LOUD", "String should match pattern"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_to_set(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        WorkerSettings()
    message = str(caught.value)
    assert message.startswith(f"{variable}={value!r} is invalid: ")
    assert expected in message
    assert f"Set {variable} (" in message and "or unset it for the default" in message


def test_the_proxy_port_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCGRPO_PROXY_PORT", "0")
    with pytest.raises(SettingsError, match=r"ASYNCGRPO_PROXY_PORT='0' is invalid: .*>= 1, <= 65535"):
        ProxySettings()


def test_an_empty_value_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HEARTBEAT_S", "TOKEN", "GENERATION_BACKEND", "METRICS_PORT", "WORKER_ID", "VLLM_ENGINE_ARGS"):
        monkeypatch.setenv(f"ASYNCGRPO_{name}", "")
    settings = WorkerSettings()
    assert (settings.heartbeat_s, settings.token, settings.generation_backend) == (5.0, None, None)
    assert settings.metrics_port is None and settings.worker_id and settings.vllm_engine_args == {}


def test_the_token_is_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCGRPO_TOKEN", "s3cret-value")
    monkeypatch.setenv("ASYNCGRPO_HEARTBEAT_S", "-1")  # an error message must not leak the token either
    with pytest.raises(SettingsError) as caught:
        WorkerSettings()
    assert "s3cret-value" not in str(caught.value)
    monkeypatch.delenv("ASYNCGRPO_HEARTBEAT_S")
    settings = WorkerSettings()
    assert "s3cret-value" not in repr(settings) and settings.token_value() == "s3cret-value"


def test_sections_read_only_their_own_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Logging and storage work in any process: a bad worker variable does not break them."""
    monkeypatch.setenv("ASYNCGRPO_HEARTBEAT_S", "soon")
    monkeypatch.setenv("ASYNCGRPO_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("ASYNCGRPO_S3_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("ASYNCGRPO_CACHE", "~/elsewhere")
    assert LogSettings().log_level == "DEBUG"
    assert StorageSettings().s3_endpoint_url == "http://127.0.0.1:1"
    assert CacheSettings().cache == Path.home() / "elsewhere"


def test_the_table_names_match_the_fields() -> None:
    assert env_name("heartbeat_s") == "ASYNCGRPO_HEARTBEAT_S"
    assert "ASYNCGRPO_WORKER_ROLE" in {env_name(field) for field in WorkerSettings.model_fields}


def test_open_bucket_takes_the_s3_endpoint_from_its_caller_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's settings hold the endpoint; the bucket code never reads the environment itself."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("ASYNCGRPO_S3_ENDPOINT_URL", "http://127.0.0.1:1")
    assert open_bucket("s3://b/p").endpoint_url is None  # type: ignore[attr-defined]
    settings = StorageSettings()
    given = open_bucket("s3://b/p", s3_endpoint_url=settings.s3_endpoint_url)
    assert isinstance(given, S3Bucket) and given.endpoint_url == "http://127.0.0.1:1"
    assert S3Bucket("b", "p").endpoint_url is None


def test_the_launcher_passes_the_role_and_checks_settings_first(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(launcher.os, "execvpe", lambda file, argv, env: calls.append((file, argv, env)))
    monkeypatch.setenv("ASYNCGRPO_CELERY_LOGLEVEL", "debug")
    monkeypatch.setenv("ASYNCGRPO_RUN", "r1")
    launcher.run_worker("optimize", ["--without-gossip"])
    _, argv, env = calls[0]
    assert argv[argv.index("--loglevel") + 1] == "debug" and argv[-1] == "--without-gossip"
    assert env[launcher.ROLE_ENV] == "optimize"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert WorkerSettings().worker_role == "optimize"
    monkeypatch.setenv("ASYNCGRPO_HEARTBEAT_S", "soon")
    with pytest.raises(SettingsError, match="ASYNCGRPO_HEARTBEAT_S"):
        launcher.run_worker("generate", [])
    assert len(calls) == 1


def test_python_m_proxy_reports_settings_errors_and_a_missing_run(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    result = runner.invoke(proxy_main, [])
    assert result.exit_code == 2 and "pass --run NAME or set ASYNCGRPO_RUN" in result.output
    monkeypatch.setenv("ASYNCGRPO_TICK_S", "fast")
    result = runner.invoke(proxy_main, ["--run", "r1"])
    assert result.exit_code == 1 and "ASYNCGRPO_TICK_S='fast' is invalid" in result.output


def _environment_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read the environment. Copying it whole into a child process's (``dict(os.environ)``)
    is not reading a setting, nor is vLLM's ``os.environ.setdefault`` (it configures vLLM, not us)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for alias in node.names if alias.name in ("environ", "getenv")]
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"):
            continue
        if node.attr not in ("environ", "getenv", "environb"):
            continue
        parent = parents.get(node)
        copied = isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "dict"
        setdefault = isinstance(parent, ast.Attribute) and parent.attr == "setdefault"
        if not (copied or setdefault):
            lines.append(node.lineno)
    return lines


def test_only_the_settings_modules_read_the_environment() -> None:
    offenders = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative not in SETTINGS_MODULES and (lines := _environment_reads(path)):
                offenders[relative] = lines
    assert not offenders, (
        f"read these through a settings class (asyncgrpo/protocol/settings.py or a role's): {offenders}"
    )


def test_an_optimize_worker_consumes_its_own_queue_too() -> None:
    """Steps are routed to the trainer that holds their base version through that worker's own queue."""
    argv = launcher.celery_worker_argv("optimize", "r1", "opt-7", [])
    queues = argv[argv.index("--queues") + 1].split(",")
    assert queues == ["asyncgrpo:r1:optimize", "asyncgrpo:r1:optimize:opt-7"]
    argv = launcher.celery_worker_argv("generate", "r1", "gen-1", [])
    assert argv[argv.index("--queues") + 1] == "asyncgrpo:r1:generate"


def test_a_worker_without_a_usable_run_or_id_does_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker consumes one run's queues: without ASYNCGRPO_RUN it would not know which."""
    calls: list[list[str]] = []
    monkeypatch.setattr(launcher.os, "execvpe", lambda file, argv, env: calls.append(argv))
    with pytest.raises(SettingsError, match="ASYNCGRPO_RUN is not set: a worker consumes the Celery queues of one"):
        launcher.run_worker("generate", [])
    monkeypatch.setenv("ASYNCGRPO_RUN", "a:b")  # ':' separates a queue name's parts
    with pytest.raises(SettingsError, match="ASYNCGRPO_RUN='a:b' is invalid: run name 'a:b' cannot name a queue"):
        launcher.run_worker("generate", [])
    monkeypatch.setenv("ASYNCGRPO_RUN", "r1")
    monkeypatch.setenv("ASYNCGRPO_WORKER_ID", "gpu,1")  # a comma would split `celery worker --queues`
    with pytest.raises(SettingsError, match="ASYNCGRPO_WORKER_ID='gpu,1' is invalid"):
        launcher.run_worker("optimize", [])
    assert calls == []
    monkeypatch.delenv("ASYNCGRPO_RUN")
    monkeypatch.delenv("ASYNCGRPO_WORKER_ID")
    result = CliRunner().invoke(cli_main, ["worker", "generate"])
    assert result.exit_code == 1 and "Error: ASYNCGRPO_RUN is not set" in result.output, result.output


# Where a process reads its environment: its entry, once (`cli.main` for every command, `proxy.__main__`
# for the proxy, `worker.process.settings.process_settings` for a worker process, the launcher before it execs
# Celery). Everything else is handed the settings object.
SETTINGS_ENTRIES = {
    "cli/main.py",
    "proxy/__main__.py",
    "worker/process/settings.py",
    "worker/process/launcher.py",
}
SETTINGS_CLASSES = {
    "AsyncgrpoSettings",
    "LogSettings",
    "StorageSettings",
    "CacheSettings",
    "CommonSettings",
    "ProxySettings",
    "GenerateSettings",
    "WorkerSettings",
    "load_worker_settings",
}


def _settings_parsed(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in SETTINGS_CLASSES:
                lines.append(node.lineno)
    return lines


def test_settings_are_parsed_only_at_a_process_entry() -> None:
    offenders = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative not in SETTINGS_ENTRIES and (lines := _settings_parsed(path)):
                offenders[relative] = lines
    assert not offenders, f"pass the process's settings object down instead of parsing them here: {offenders}"
