#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (unit + integration). Extra args go to pytest,
# e.g. scripts/test.sh tests/unit_tests -k config
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
.venv/bin/python -m pytest "${@:-tests}" -q -p no:cacheprovider
code=$?
if [[ $code == 5 ]]; then
  echo "error: pytest collected no tests" >&2
fi
exit $code
