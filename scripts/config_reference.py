"""Write docs/configuration.md's reference tables (Markdown) from the pydantic models themselves.

Its "Run config" table is ``reference()`` (from ``RunConfig``), its "Environment variables" table
``env_reference()`` (from the settings classes), each between its pair of markers;
tests/unit/project/test_readme.py fails when either differs.
    python scripts/config_reference.py --write   # regenerate both tables in docs/configuration.md
    python scripts/config_reference.py --check   # exit 1 when either table is not current
    python scripts/config_reference.py [--env]   # print one table
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

# This checkout's proxy package, not whichever asyncgrpo happens to be installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncgrpo.protocol.settings import env_name, field_bounds, shown_default
from asyncgrpo.run.config import RunConfig
from proxy.api.settings import ProxySettings
from worker.process.settings import WorkerSettings


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value: Any = info.default_factory()
        if isinstance(value, BaseModel):
            return "(table)"
        if isinstance(value, list) and value and isinstance(value[0], BaseModel):
            return str([item.stored() if hasattr(item, "stored") else item.model_dump() for item in value])
        return repr(value)
    return "required" if info.is_required() else repr(info.default)


def _item_model(annotation: Any) -> type[BaseModel] | None:
    """The entry model of a list-of-tables field (``list[RewardConfig]``), else None."""
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
    return None


def _optional_table(annotation: Any) -> Any:
    """``Table | None`` (a table that may be left out, ``[agent]``) as the table, to list its fields."""
    arguments = [argument for argument in get_args(annotation) if argument is not type(None)]
    if type(None) in get_args(annotation) and len(arguments) == 1:
        (only,) = arguments
        if isinstance(only, type) and issubclass(only, BaseModel):
            return only
    return annotation


def rows(model: type[BaseModel], prefix: str = "", expanded: set[type[BaseModel]] | None = None) -> list[str]:
    """One row per field; a table's fields under its name, and a list of tables' entry fields once (the first
    list of that entry model: ``rewards.name``, not again under ``eval.rewards``)."""
    expanded = set() if expanded is None else expanded
    lines = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        annotation = _optional_table(info.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.extend(rows(annotation, key + ".", expanded))
            continue
        description = (info.description or "").replace("|", "\\|")
        lines.append(f"| `{key}` | `{_default(info)}` | {field_bounds(info)} | {description} |")
        item = _item_model(annotation)
        if item is not None and item not in expanded:
            expanded.add(item)
            lines.extend(rows(item, key + ".", expanded))
    return lines


def reference() -> str:
    header = ["| field | default | bounds | meaning |", "|---|---|---|---|"]
    return "\n".join(header + rows(RunConfig)) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def env_reference() -> str:
    """One row per environment variable of the settings classes: the proxy's, then the workers' own."""
    roles = {"proxy": ProxySettings.model_fields, "workers": WorkerSettings.model_fields}
    names = list(dict.fromkeys([*roles["proxy"], *roles["workers"]]))
    lines = ["| variable | used by | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name in names:
        users = [role for role, fields in roles.items() if name in fields]
        defaults = {role: shown_default(roles[role][name]) for role in users}
        info = roles[users[0]][name]
        shown = {role: value if value == "unset" else f"`{value}`" for role, value in defaults.items()}
        if len(set(shown.values())) == 1:
            default = shown[users[0]]
        else:
            default = ", ".join(f"{role}: {value}" for role, value in shown.items())
        used_by = "all" if len(users) == len(roles) else users[0]
        lines.append(
            f"| `{env_name(name)}` | {used_by} | {_cell(default)} | {_cell(field_bounds(info))} | "
            f"{_cell(info.description or '')} |"
        )
    return "\n".join(lines) + "\n"


DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
# Each generated table sits between its two markers in DOC; the text around them is written by hand.
TABLES = {"config-reference": reference, "env-reference": env_reference}


def _span(text: str, name: str) -> tuple[int, int]:
    """Where the table called ``name`` starts and ends in ``text`` (between its markers)."""
    start_marker, end_marker = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    start = text.index(start_marker) + len(start_marker)
    return start, text.index(end_marker, start)


def current_table(text: str, name: str) -> str:
    start, end = _span(text, name)
    return text[start:end]


def with_tables(text: str) -> str:
    """``text`` with every generated table replaced by what the models say now."""
    for name, table in TABLES.items():
        start, end = _span(text, name)
        text = text[:start] + table() + text[end:]
    return text


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        DOC.write_text(with_tables(DOC.read_text()))
        return 0
    if argv == ["--check"]:
        text = DOC.read_text()
        stale = [name for name, table in TABLES.items() if current_table(text, name) != table()]
        if stale:
            sys.stderr.write(
                f"{DOC.name}: {', '.join(stale)} out of date; run python3 scripts/config_reference.py --write\n"
            )
            return 1
        return 0
    sys.stdout.write(env_reference() if argv == ["--env"] else reference())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
