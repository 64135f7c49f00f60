#!/usr/bin/env bash
# A local fault-tolerant job: a torchft lighthouse on 127.0.0.1 plus N replica groups, each a
# ./run_train.sh, every output line prefixed with its group:
#   ./run_launcher.sh --groups 2 -- --job.custom_args_module=... --training.steps=100
# Before "--": the launcher's options (./run_launcher.sh --help lists them); after it: every
# group's training flags.
#   PYTHON   interpreter. Default: .venv/bin/python if present, else python3.
#   RUST_LOG torchft's own log level. Default: warn (RUST_LOG=info shows its quorum lines).
set -euo pipefail
cd "$(dirname "$0")"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" -m torchtitan.experiments.fault_tolerance.launch.launcher "$@"
