"""The toy agent task's environment with faults, for the end-to-end fault test: of the reveal() calls a generate
worker's tool process serves, call 1 raises, call 1 + SPACING returns a dict, then one hangs past any timeout, one
exits the process and one crashes it with SIGSEGV, SPACING calls apart; every other call behaves. SPACING is more
than one generate task can make (groups_per_task x samples_per_prompt x max_tool_calling_iterations = 64 in the
test), so each fault falls in a task of its own. The count lives in a file named after the worker's process (the
tool process's parent), so a restarted tool process goes on with the next fault instead of starting over."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

from worker.generate.toy_agent import HiddenDigit

FAULTS = ("raise", "non_text", "hang", "exit", "segfault")
SPACING = 70


def script_file(worker_pid: int) -> Path:
    """Where the generate worker with this pid counts the reveal() calls its tool processes served."""
    return Path(tempfile.gettempdir()) / f"asyncgrpo-e2e-faults-{worker_pid}.count"


class FaultyDigit(HiddenDigit):
    def reveal(self) -> str:
        """Show the hidden digit, after the scripted faults.

        Returns:
            The digit this conversation must repeat.
        """
        path = script_file(os.getppid())
        calls = int(path.read_text()) if path.exists() else 0
        # Before the fault, so a crash does not replay it; written aside and renamed, so the test never reads
        # the truncated file a plain write leaves for a moment.
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(str(calls + 1))
        os.replace(staged, path)
        fault = FAULTS[calls // SPACING] if calls % SPACING == 0 and calls // SPACING < len(FAULTS) else None
        if fault == "raise":
            raise RuntimeError("the digit is stuck")
        if fault == "non_text":
            return {"digit": self.digit}  # type: ignore[return-value]
        if fault == "hang":
            time.sleep(3600)
        if fault == "exit":
            os._exit(3)
        if fault == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(60)
        return super().reveal()
