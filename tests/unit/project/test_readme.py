"""README and docs/ stay true: the generated tables are the models', the docs name every endpoint, error code
and variable, every link and path resolves, and README stays short with its two commands the Makefile's."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from asyncgrpo.protocol.errors import ERROR_CODES
from asyncgrpo.run.config import parse_run_config
from scripts import config_reference
from scripts.config_reference import TABLES, current_table, env_reference, reference, with_tables
from tests.support.paths import PACKAGES, REPO_ROOT

ROOT = REPO_ROOT
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
CONFIGURATION = (DOCS / "configuration.md").read_text()
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300


def test_config_reference_table_matches_the_model() -> None:
    assert current_table(CONFIGURATION, "config-reference") == reference(), (
        "regenerate it: python3 scripts/config_reference.py --write"
    )


def test_environment_table_matches_the_settings_classes() -> None:
    assert current_table(CONFIGURATION, "env-reference") == env_reference(), (
        "regenerate it: python3 scripts/config_reference.py --write"
    )


def test_the_generator_writes_and_checks_the_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_reference.main(["--check"]) == 0
    stale = "\n".join(
        f"before {name}\n<!-- {name}:start -->\n| old |\n<!-- {name}:end -->\nafter {name}" for name in TABLES
    )
    doc = tmp_path / "configuration.md"
    doc.write_text(stale)
    monkeypatch.setattr(config_reference, "DOC", doc)
    assert config_reference.main(["--check"]) == 1
    assert config_reference.main(["--write"]) == 0
    written = doc.read_text()
    assert written == with_tables(stale)
    assert current_table(written, "config-reference") == reference()
    assert current_table(written, "env-reference") == env_reference()
    assert "before config-reference" in written and "after env-reference" in written  # the prose is kept
    assert config_reference.main(["--check"]) == 0


def test_every_endpoint_is_documented() -> None:
    api = (DOCS / "http-api.md").read_text()
    source = (ROOT / "proxy" / "api" / "app.py").read_text()
    routes = re.findall(r'@app\.(get|post|delete)\("([^"]+)"', source)
    assert routes
    for method, path in routes:
        assert f"`{method.upper()} {path}`" in api, f"docs/http-api.md's table lacks {method.upper()} {path}"


def test_every_error_code_is_documented() -> None:
    api = (DOCS / "http-api.md").read_text()
    missing = [code for code in ERROR_CODES if f"`{code}`" not in api]
    assert not missing, f"docs/http-api.md does not name {missing}"


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


def test_the_from_trl_page_names_only_config_fields_and_metrics_that_exist() -> None:
    section = (DOCS / "from-trl.md").read_text()
    fields = set(re.findall(r"^\| `([\w.]+)` \|", reference(), flags=re.MULTILINE))
    tables = {row.split(".")[0] for row in fields if "." in row}
    mapping = section[section.index("| TRL (") : section.index("Metrics keep TRL's names")]
    named = set()
    for row in mapping.splitlines()[2:]:
        if row.startswith("|"):
            ours = row.split(" | ")[-1]
            named |= {name for name in re.findall(r"`([a-z_]+\.[a-z_]+)`", ours) if name.split(".")[0] in tables}
    assert named, "the mapping table names no config field"
    assert named - fields == set(), "docs/from-trl.md names config fields that do not exist"
    # A bare field after a dotted one in the same cell (`optimizer.learning_rate`, `lr_schedule`) is checked too.
    for row in mapping.splitlines()[2:]:
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


# --- README's shape ---------------------------------------------------------------------------------------


def test_readme_is_short() -> None:
    lines = README.count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: move reference to docs/ and link it"


def test_readme_links_every_doc() -> None:
    linked = {match for match in re.findall(r"\]\(docs/([\w.-]+\.md)", README)}
    assert linked == {path.name for path in DOCS.glob("*.md")}, "README's Documentation table is off"


def test_the_two_commands_are_the_makefile_and_ci_ones() -> None:
    block = re.search(r"## The two commands\n.*?```bash\n(.*?)```", README, flags=re.DOTALL)
    assert block, "README lost its two commands"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    test = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    assert demo and "asyncgrpo demo" in demo.group(1)
    assert test and "pytest" in test.group(1) and "ruff check" in test.group(1) and "lint-imports" in test.group(1)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert [line for line in ci if line and not line.startswith("#")][-1] == "make test", (
        ".ci/run must end in make test"
    )


def test_readme_run_config_example_is_a_valid_config_of_a_real_example() -> None:
    """The example's fields validate, and each holds what examples/gpu-qwen2.5-math-1.5b.toml holds."""
    block = re.search(r"```toml\n(.*?)```", README, flags=re.DOTALL)
    assert block
    shown = tomllib.loads(block.group(1))
    parse_run_config(shown, "README.md")
    example = tomllib.loads((ROOT / "examples" / "gpu-qwen2.5-math-1.5b.toml").read_text())
    for table, values in shown.items():
        if isinstance(values, list):  # [[rewards]]
            assert values == example[table], table
            continue
        for key, value in values.items():
            assert example[table][key] == value, f"{table}.{key}"


# --- links, anchors and paths ------------------------------------------------------------------------------

FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``# comment`` in a shell block is no heading)."""
    return FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    """The #anchors GitHub makes of a Markdown file's headings (a repeated one gets -1, -2, ...)."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _prose(text), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def test_anchors_follow_github() -> None:
    assert anchors("# A b\n## Any config: `asyncgrpo local`\n## What happens when...\n## A b\n") == {
        "a-b",
        "any-config-asyncgrpo-local",
        "what-happens-when",
        "a-b-1",
    }
    assert anchors("```bash\n# proxy machine\n```\n") == set()


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        anchored = not anchor or (file.suffix == ".md" and anchor in anchors(file.read_text()))
        if not (file.exists() and anchored):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links that lead nowhere: {broken}"


def _top_level() -> set[str]:
    return {path.name for path in ROOT.iterdir() if not path.name.startswith(".") or path.name == ".ci"}


def repo_paths(text: str) -> set[str]:
    """Backticked repository paths in ``text``: ones whose first part is a top-level entry, without placeholders
    (``tests/unit/<package>/``, ``runs/<run>/...``)."""
    roots = _top_level()
    found = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        if re.search(r"[<>*{}|…]|\.\.\.", token) or ":" in token:
            continue
        first, last = token.split("/")[0], token.rstrip("/").split("/")[-1]
        # A folder ends in "/", a file has a suffix; `asyncgrpo/max_staleness` is a metric's name.
        looks_like_path = token.endswith("/") or "." in last or (ROOT / token).exists()
        if first in roots and looks_like_path and ("/" in token or (ROOT / token).is_file()):
            found.add(token)
    return found


def test_repo_paths_finds_paths_and_skips_placeholders() -> None:
    text = (
        "`worker/model/attention.py`, `Makefile`, `deploy/nothing/`, `tests/unit/<package>/`, `runs/<run>/x`, "
        "`make test`, `asyncgrpo/max_staleness`"
    )
    assert repo_paths(text) == {"worker/model/attention.py", "Makefile", "deploy/nothing/"}


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_backticked_repo_path_exists(page: Path) -> None:
    missing = sorted(path for path in repo_paths(page.read_text()) if not (ROOT / path).exists())
    assert not missing, f"{page.relative_to(ROOT)} names paths the tree lacks: {missing}"


def test_the_layout_tree_names_folders_that_exist() -> None:
    """Each folder of docs/layout.md's tree, nested by its indent, is a folder of the repository."""
    layout = (DOCS / "layout.md").read_text()
    tree = re.search(r"```\n(.*?)```", layout, flags=re.DOTALL)
    assert tree
    parents: list[tuple[int, str]] = []
    named = []
    for line in tree.group(1).splitlines():
        match = re.match(r"^( *)([\w.<>-]+)/ ", line)
        if not match:
            continue
        indent, name = len(match.group(1)), match.group(2)
        parents = [(depth, folder) for depth, folder in parents if depth < indent]
        path = "/".join([folder for _, folder in parents] + [name])
        parents.append((indent, name))
        if "<" not in name:
            named.append(path)
    assert "proxy/coordinator" in named and "worker/algo" in named
    missing = [path for path in named if not (ROOT / path).is_dir()]
    assert not missing, f"docs/layout.md's tree names folders that do not exist: {missing}"


def test_the_sample_path_table_names_modules_that_exist() -> None:
    """In the path of one sample, a bare module name is in the folder of the last path before it."""
    layout = (DOCS / "layout.md").read_text()
    table = layout[layout.index("**The path of one sample**") :]
    checked, missing = 0, []
    for row in table.splitlines():
        if not row.startswith("| ") or row.startswith("| step"):
            continue
        folder = ""
        for name in re.findall(r"`([\w/]+\.py)`", row.split(" | ")[-1]):
            folder = name.rsplit("/", 1)[0] if "/" in name else folder
            path = name if "/" in name else f"{folder}/{name}"
            checked += 1
            if not (ROOT / path).is_file():
                missing.append(path)
    assert checked > 20 and not missing, missing


def test_the_layout_names_only_coordinator_modules_that_exist() -> None:
    layout = (DOCS / "layout.md").read_text()
    sentence = layout[layout.index("inside the coordinator") : layout.index("inside the workers")]
    words = set(re.findall(r"\b([a-z][a-z_]+)\b", sentence)) - {"inside", "the", "coordinator", "seams"}
    modules = {path.stem for path in (ROOT / "proxy" / "coordinator").glob("*.py")}
    assert words and words <= modules, sorted(words - modules)
