#!/usr/bin/env bash
# Make .venv/ ready to run the project: create it, install torch 2.13.0 (CPU wheel on machines
# without CUDA) when torch is missing, then this package with its dependencies. Re-running is
# cheap: it reinstalls only when pyproject.toml changed. pip compiles the .pyc files at install:
# where PYTHONDONTWRITEBYTECODE is set (as on our CI machines), Python never writes them itself,
# and every process would compile torch's sources again (a test suite twice as slow).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON_FOR_VENV:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
fi
stamp=.venv/.torchtitan-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  echo "[setup] installing torchtitan and its dependencies into .venv"
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[dev]"
  touch "$stamp"
fi
