"""Limits on what a request may carry, shared by the request schemas and the proxy's error answers.

Everything a client sends is bounded: identifiers by ``schemas.ID_PATTERN``, numbers by ``MAX_INT``, text and
lists by their lengths, free-form maps by entry count and encoded size, and the whole body by the proxy's
``ASYNCGRPO_MAX_BODY_BYTES``. Text must be valid UTF-8: JSON's ``"\\ud800"`` escape decodes to a lone
surrogate, which no JSON encoder, Redis script or log line can write back.
"""

from __future__ import annotations

import json
from typing import Any

MAX_INT = 2**31 - 1
"""Versions, steps, pids and counts: far beyond any run, and exact as a double (Lua) and in every JSON reader."""
MAX_LIST = 4096
"""Entries of an id list in one request (a task's groups, a step's rollouts)."""
MAX_MAP_ENTRIES = 64
"""Entries of a free-form map (a submission's ``stats``, a heartbeat's ``info``)."""
MAX_NAME_CHARS = 64
"""A key of a free-form map."""
MAX_INFO_BYTES = 16 * 1024
"""A heartbeat's ``info`` map, encoded as JSON."""


def is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_unicode(value: Any) -> Any:
    """``value`` unchanged if every string in it (keys included) is valid UTF-8; else ValueError."""
    pending = [value]
    while pending:  # iterative: a deeply nested value must not overflow the stack here
        item = pending.pop()
        if isinstance(item, str):
            if not is_valid_unicode(item):
                raise ValueError("text holds a lone surrogate (e.g. from a \\ud800 escape); send valid UTF-8")
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return value


def bounded_json(value: dict[str, Any], limit: int = MAX_INFO_BYTES) -> dict[str, Any]:
    """``value`` unchanged if it encodes to at most ``limit`` bytes of JSON (no NaN/Infinity); else ValueError."""
    try:
        size = len(json.dumps(value, allow_nan=False, separators=(",", ":")).encode())
    except (ValueError, TypeError, RecursionError) as error:
        raise ValueError(f"must be plain JSON (finite numbers, text, lists, maps): {error}") from None
    if size > limit:
        raise ValueError(f"encodes to {size} bytes of JSON; at most {limit} are kept")
    return value


def printable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters and made safe to send back (lone surrogates escaped)."""
    cut = text[:limit]
    safe = cut.encode("utf-8", "backslashreplace").decode("utf-8")
    return safe + ("..." if len(text) > limit else "")
