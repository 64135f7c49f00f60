#!/usr/bin/env bash
# Make .venv/ ready to run the project (scripts/setup.sh [run|dev]): create it, install torch 2.13.0 (CPU wheel on machines
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
# `scripts/setup.sh run`: what training needs only (the demo); default: the dev tools too (the
# tests: pytest, ruff, mypy). The stamp says what was installed, so a later full setup adds them.
want=${1:-dev}
stamp=.venv/.torchtitan-installed
have=$(cat "$stamp" 2>/dev/null || true)
if [[ ! -f $stamp || pyproject.toml -nt $stamp || ($want == dev && $have != dev) ]]; then
  if [[ $want == dev ]]; then spec=".[dev]"; else spec="."; fi
  echo "[setup] installing torchtitan and its dependencies into .venv ($want)"
  .venv/bin/pip install --quiet --disable-pip-version-check -e "$spec"
  if [[ $want == dev || $have == dev ]]; then echo dev > "$stamp"; else echo run > "$stamp"; fi
fi
