"""The folders draw the architecture: each package's docstring is its map, no import cycles.

The import directions themselves are import-linter contracts in pyproject.toml (`lint-imports`, run by
`make test`); this file checks what a contract cannot: that every map names exactly the modules of its
package, and that no two modules import each other, even through imports placed inside functions. There is
no line target: a module is as long as its one concept needs (a target made modules split along no seam); past
``MAX_MODULE_LINES`` a module holds more than one concept, and is split along a seam.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

from tests.support.paths import PACKAGES, REPO_ROOT

ROOT = REPO_ROOT
MAP_ENTRY = re.compile(r"^    (\w+)\s{2,}\S")
MAX_MODULE_LINES = 800


def test_every_package_is_shipped_and_under_the_import_contracts() -> None:
    """A top package that pip does not ship, or that import-linter does not see, escapes the architecture."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(shipped) == sorted(f"{top}*" for top in PACKAGES)
    assert sorted(pyproject["tool"]["importlinter"]["root_packages"]) == sorted(PACKAGES)
    on_disk = {init.parent.name for init in ROOT.glob("*/__init__.py")} - {"tests", "scripts"}
    assert on_disk == set(PACKAGES)
    entry = pyproject["project"]["scripts"]["asyncgrpo"]
    assert entry.split(".")[0] == "cli", "the asyncgrpo binary is the top floor's command line"


def packages() -> list[Path]:
    return sorted(init.parent for top in PACKAGES for init in (ROOT / top).rglob("__init__.py"))


def modules() -> list[Path]:
    return sorted(path for top in PACKAGES for path in (ROOT / top).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def map_entries(package: Path) -> list[str]:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return [match.group(1) for line in docstring.splitlines() if (match := MAP_ENTRY.match(line))]


@pytest.mark.parametrize("package", packages(), ids=lambda p: module_name(p / "__init__.py"))
def test_package_docstring_maps_exactly_its_modules(package: Path) -> None:
    present = {p.stem for p in package.glob("*.py") if not p.stem.startswith("__")}
    present |= {p.parent.name for p in package.glob("*/__init__.py")}
    listed = map_entries(package)
    assert listed, f"{package.relative_to(ROOT)}/__init__.py needs a docstring map: one line per module"
    assert len(listed) == len(set(listed)), f"{package.relative_to(ROOT)}: a module is listed twice"
    assert set(listed) == present, (
        f"{package.relative_to(ROOT)}/__init__.py map is off: add {sorted(present - set(listed))}, "
        f"remove {sorted(set(listed) - present)}"
    )


def _imports(path: Path, known: set[str]) -> set[str]:
    """First-party modules ``path`` imports, wherever the import stands (in a function or under TYPE_CHECKING
    too: a cycle hidden that way is still a cycle in the design)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in candidates if name in known}
    return found


def test_no_import_cycles() -> None:
    names = {module_name(path): path for path in modules()}
    graph = {name: _imports(path, set(names)) - {name} for name, path in names.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles (break them; an import inside a function does not count as a fix): " + (
        "; ".join(" -> ".join(cycle) for cycle in cycles)
    )


EVENT_NAME = re.compile(r"[a-z_]+(\.[a-z_]+)+")
LOG_METHODS = frozenset({"debug", "info", "warning", "error", "exception", "critical"})


def test_log_events_are_dotted_names() -> None:
    """One style of event names (`generate.submitted`): a dashboard or `grep` can match an event exactly, and
    what varies goes in key=value fields, never in the event. An f-string may only fill in the role."""
    offenders = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LOG_METHODS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "log"
                and node.args
            ):
                continue
            event = node.args[0]
            if isinstance(event, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "role" for v in event.values)
            elif isinstance(event, ast.Constant) and isinstance(event.value, str):
                text = event.value
            else:
                text = ast.unparse(event)
            if not EVENT_NAME.fullmatch(text):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {text!r}")
    assert not offenders, f"name these events component.what_happened: {offenders}"


def test_no_module_holds_more_than_one_concept_by_size() -> None:
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path in modules()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split each along a seam): {too_long}"
