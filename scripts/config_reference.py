"""Print the run config reference (a Markdown table) from the pydantic model itself.

README's "Run config" table is this script's output; tests/test_readme.py fails when they differ.
    python scripts/config_reference.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

# This checkout's proxy package, not whichever asyncgrpo happens to be installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.run.config import RunConfig


def _bounds(info: FieldInfo) -> str:
    parts = []
    for item in info.metadata:
        for name, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "len >=")):
            value = getattr(item, name, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    return ", ".join(parts)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value: Any = info.default_factory()
        if isinstance(value, BaseModel):
            return "(table)"
        if isinstance(value, list) and value and isinstance(value[0], BaseModel):
            return str([item.model_dump() for item in value])
        return repr(value)
    return "required" if info.is_required() else repr(info.default)


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    lines = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.extend(rows(annotation, key + "."))
            continue
        description = (info.description or "").replace("|", "\\|")
        lines.append(f"| `{key}` | `{_default(info)}` | {_bounds(info)} | {description} |")
    return lines


def reference() -> str:
    header = ["| field | default | bounds | meaning |", "|---|---|---|---|"]
    return "\n".join(header + rows(RunConfig)) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
