# Set-up and entry points. `make demo` and `make test` each install what they need first.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install demo test test-fast lint bench

# torch 2.13.0 first: it is the CPU wheel on disk; letting pip choose a torch would fetch CUDA wheels.
install:
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[train,dev]'

demo: install
	asyncgrpo demo

# lint-imports checks the architecture contracts in pyproject.toml ([tool.importlinter]).
test: install
	ruff check .
	ruff format --check .
	lint-imports
	$(PYTHON) -m pytest -q -rfEs

# The edit loop: unit and contract tests in this one process against Redis and the bucket (no child process:
# tests/conftest.py refuses one where a test is not marked `processes`); the e2e tests are `make test`'s. One
# pytest-xdist worker a core: each has its own private Redis and SeaweedFS.
test-fast:
	ruff check .
	ruff format --check .
	lint-imports
	ASYNCGRPO_TESTS_NO_PROCESSES=1 $(PYTHON) -m pytest -q -n auto -m "not processes and not slow" tests/unit tests/integration

lint:
	ruff check .
	ruff format --check .
	lint-imports
