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
	lint-imports
	$(PYTHON) -m pytest -q -rs

# The edit loop: unit and integration tests only (no real processes), about 3 minutes on 2 cores; no install.
test-fast:
	ruff check .
	lint-imports
	$(PYTHON) -m pytest -q tests/unit tests/integration

lint:
	ruff check .
	lint-imports
