"""Print README's reference tables (Markdown) from the pydantic models themselves.

README's "Run config" table is this script's output, and its "Environment variables" table the output of
``--env`` (from the settings classes); tests/unit/project/test_readme.py fails when either differs.
    python scripts/config_reference.py
    python scripts/config_reference.py --env
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


if __name__ == "__main__":
    sys.stdout.write(env_reference() if sys.argv[1:] == ["--env"] else reference())
