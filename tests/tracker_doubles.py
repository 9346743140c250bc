"""Trackers for tests: real trackio in a temporary directory, and stand-ins for the libraries not installed.

trackio reads ``TRACKIO_DIR`` once, at import: ``trackio_dir()`` points it at one temporary directory for the
whole test session before the first import (each test logs to a project of its own), and the end-to-end test
hands the same directory to the proxy it starts. ``FAKE_WANDB`` is a ``wandb`` package whose ``init``
raises, put on a real proxy's PYTHONPATH to show that a tracker that fails does not stop the run.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

_SESSION_DIR: list[Path] = []


def trackio_dir() -> Path:
    """Where this process's trackio stores its projects (a temporary directory, set before its import)."""
    if not _SESSION_DIR:
        if "trackio" not in sys.modules:
            os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="asyncgrpo-trackio-")
            atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)
        import trackio.utils

        _SESSION_DIR.append(Path(trackio.utils.TRACKIO_DIR))
    return _SESSION_DIR[0]


def trackio_logs(project: str, run: str) -> list[dict[str, Any]]:
    """Every row trackio stored for ``run``, in step order, read back through trackio's own storage."""
    trackio_dir()
    from trackio.sqlite_storage import SQLiteStorage

    return sorted(SQLiteStorage.get_logs(project, run), key=lambda row: row["step"])


def trackio_config(project: str, run: str) -> dict[str, Any] | None:
    trackio_dir()
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_run_config(project, run)


FAKE_WANDB = '''\
"""A wandb stand-in whose every call raises, as a tracker with a wrong key or no network would."""


def init(**kwargs):
    raise RuntimeError("fake wandb: init refused")
'''


def write_fake_wandb(folder: Path) -> Path:
    """A folder to put first on PYTHONPATH: ``import wandb`` there gets a library that always raises."""
    package = folder / "wandb"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(FAKE_WANDB)
    return folder
