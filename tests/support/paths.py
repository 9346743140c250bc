"""Where the repository is, for tests that read its files."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# The packages `pip install` ships, from the top floor down: the command line, the two processes, what they share.
PACKAGES = ("cli", "proxy", "worker", "asyncgrpo")
