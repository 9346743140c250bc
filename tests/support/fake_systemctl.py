"""A stand-in for ``systemctl`` on a machine without systemd as PID 1: the scaler's commands against a JSON file.

Run as ``python fake_systemctl.py STATE_FILE <systemctl arguments>`` (the tests write a one-line wrapper that
passes the file). It answers the three commands ``cli.scaler.SystemdUnits`` sends, in systemctl's
output format, and keeps each unit's ACTIVE state (``active``, ``inactive``, ``failed``...) in the file, with
every command it was given, so a test reads what was started and stopped.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path


def main(state_path: Path, args: list[str]) -> int:
    state = json.loads(state_path.read_text()) if state_path.exists() else {"units": {}, "calls": []}
    state["calls"].append(args)
    command, rest = args[0], [a for a in args[1:] if not a.startswith("--")]
    code = 0
    if command == "list-units":
        (pattern,) = rest
        for unit, active in sorted(state["units"].items()):
            if fnmatch.fnmatch(unit, pattern) and ("--all" in args or active != "inactive"):
                sub = {"active": "running", "activating": "start", "failed": "failed"}.get(active, "dead")
                print(f"{unit} loaded {active} {sub} asyncgrpo generate worker")
    elif command in ("start", "stop"):
        for unit in rest:
            if state.get("refuse") == unit:
                print(f"Failed to {command} {unit}: Unit {unit} is masked.", file=sys.stderr)
                code = 1
                continue
            state["units"][unit] = "active" if command == "start" else "inactive"
    else:
        print(f"fake systemctl: unknown command {command}", file=sys.stderr)
        code = 2
    state_path.write_text(json.dumps(state))
    return code


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
