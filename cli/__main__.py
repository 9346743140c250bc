"""``python -m cli``: the ``asyncgrpo`` command line, for processes started by module (local clusters, tests)."""

from cli.main import main

main(prog_name="asyncgrpo")
