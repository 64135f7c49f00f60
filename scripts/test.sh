#!/usr/bin/env bash
# Set up .venv if needed, then run, stopping at the first that fails and naming it:
#   lint        ruff check .
#   format      ruff format --check .
#   typecheck   mypy (on torchtitan/, as configured in pyproject.toml)
#   layers      scripts/arch_check.py: imports go down the layers, no cycles, no calls back
#               up, few forwarding methods (limits in the script)
#   compile     byte-compile torchtitan/, tests/ and benchmarks/ (see below)
#   tests       pytest tests (unit + integration) in TEST_WORKERS processes (default 2,
#               pytest-xdist; one file's tests stay in one process); no tests is a failure;
#               the 30 slowest tests are listed at the end (where the suite's time goes)
# Extra args go to pytest, e.g. scripts/test.sh tests/unit_tests -k config; the four checks
# run then too (seconds, once mypy's cache is warm).
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1

fail() {  # step name, exit status, what went wrong
  echo "error: scripts/test.sh: step '$1' failed (exit $2): $3" >&2
  exit "$2"
}

check() {  # step name, command...
  local name=$1
  shift
  echo "[test] $name: $*"
  "$@" || fail "$name" $? "$*"
}

check lint .venv/bin/ruff check .
check format .venv/bin/ruff format --check .
check typecheck .venv/bin/mypy
check layers .venv/bin/python scripts/arch_check.py

# Byte-compile the repository's own modules once: with PYTHONDONTWRITEBYTECODE set (as on
# this project's sandboxes) each of the hundreds of processes the tests start compiles them
# again, 0-0.3 s of CPU per trainer process here. A source edited later is compiled anew.
check compile .venv/bin/python -m compileall -q -j 0 torchtitan tests benchmarks

workers=${TEST_WORKERS:-2}
echo "[test] tests: pytest ${*:-tests} ($workers workers)"
.venv/bin/python -m pytest "${@:-tests}" -q -p no:cacheprovider -n "$workers" --dist loadfile \
  --durations=30 --durations-min=5
code=$?
if [[ $code == 5 ]]; then
  fail tests "$code" "pytest collected no tests"
elif [[ $code != 0 ]]; then
  fail tests "$code" "pytest reported failures (see above)"
fi
