"""README stays true: its config table is the model's, and it names every file, endpoint and variable."""

from __future__ import annotations

import re

from scripts.config_reference import env_reference, reference
from tests.support.paths import PACKAGES, REPO_ROOT

ROOT = REPO_ROOT
README = (ROOT / "README.md").read_text()


def test_config_reference_table_matches_the_model() -> None:
    start = README.index("<!-- config-reference:start -->\n") + len("<!-- config-reference:start -->\n")
    end = README.index("<!-- config-reference:end -->")
    assert README[start:end] == reference(), "regenerate it: python scripts/config_reference.py"


def test_environment_table_matches_the_settings_classes() -> None:
    start = README.index("<!-- env-reference:start -->\n") + len("<!-- env-reference:start -->\n")
    end = README.index("<!-- env-reference:end -->")
    assert README[start:end] == env_reference(), "regenerate it: python scripts/config_reference.py --env"


def test_every_endpoint_is_documented() -> None:
    source = (ROOT / "proxy" / "api" / "app.py").read_text()
    routes = re.findall(r'@app\.(get|post|delete)\("([^"]+)"', source)
    assert routes
    for method, path in routes:
        assert f"`{method.upper()} {path}`" in README, f"README's API table lacks {method.upper()} {path}"


def test_every_environment_variable_named_in_the_code_is_a_setting() -> None:
    """A variable spelt out anywhere in the packages (an error message, a CLI envvar) is one the settings
    classes declare, so the generated table covers it."""
    names = set()
    for folder in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            names.update(re.findall(r"ASYNCGRPO_[A-Z0-9_]+", path.read_text()))
    assert "ASYNCGRPO_TOKEN" in names
    table = env_reference()
    missing = sorted(name for name in names if f"`{name}`" not in table)
    assert not missing, f"declare these in a settings class (asyncgrpo/protocol/settings.py or a role's): {missing}"


def test_the_from_trl_section_names_only_config_fields_and_metrics_that_exist() -> None:
    section = README[README.index("## From TRL") : README.index("## Layout")]
    fields = set(re.findall(r"^\| `([\w.]+)` \|", reference(), flags=re.MULTILINE))
    tables = {row.split(".")[0] for row in fields if "." in row}
    mapping = section[: section.index("Metrics keep TRL's names")]
    named = set()
    for row in mapping.splitlines()[4:]:
        if row.startswith("|"):
            ours = row.split(" | ")[-1]
            named |= {name for name in re.findall(r"`([a-z_]+\.[a-z_]+)`", ours) if name.split(".")[0] in tables}
    assert named, "the mapping table names no config field"
    assert named - fields == set(), "README's From TRL names config fields that do not exist"
    # A bare field after a dotted one in the same cell (`optimizer.learning_rate`, `lr_schedule`) is checked too.
    for row in mapping.splitlines()[4:]:
        cells = row.split(" | ")
        dotted = re.findall(r"`([a-z_]+)\.[a-z_]+`", cells[-1]) if row.startswith("|") else []
        for bare in re.findall(r"`([a-z_0-9]+)`", cells[-1]) if dotted else []:
            if bare not in {"true", "false", "constant", "linear", "cosine"}:
                assert any(field.endswith("." + bare) or field == bare for field in fields), bare
    metrics = set(re.findall(r"`(asyncgrpo_[a-z_]+)", section))
    code = "".join(path.read_text() for path in (ROOT / "worker").rglob("*.py")) + "".join(
        path.read_text() for path in (ROOT / "proxy").rglob("*.py")
    )
    assert metrics and {name for name in metrics if f'"{name}' not in code} == set()
