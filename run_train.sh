#!/usr/bin/env bash
# Train with the debug model on CPU (or GPUs): ./run_train.sh [--section.field=value ...]
#   NGPU=N        local processes (ranks) of this job; on CPU too (gloo). Default 1.
#   CONFIG_FILE   TOML config. Default: the debug model's.
#   LOG_RANK      ranks whose output is shown, comma-separated. Default 0.
#   PYTHON        interpreter. Default: .venv/bin/python if present, else python3.
#   RUST_LOG      torchft's own log level. Default: warn (RUST_LOG=info shows its quorum lines).
# With NGPU > 1 it runs torchrun (--standalone) through torchtitan.tools.loopback_torchrun, so that
# torchrun's own stores listen on 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")"

NGPU=${NGPU:-1}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-./torchtitan/models/llama3/train_configs/debug_model.toml}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

for arg in "$@"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then NGPU=1; fi  # help once, not once per rank
done
if [[ "$NGPU" == 1 ]]; then
  exec "$PYTHON" -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"
fi
# Check the config once before starting NGPU ranks: a bad value then gives one error line,
# not one per rank followed by torchrun's failure report. Status 3: the config names a command
# to run instead (printed one argument per line), e.g. a semi-sync job's launcher.
set +e
INSTEAD=$(WORLD_SIZE="$NGPU" "$PYTHON" -c 'import sys; from torchtitan.train import check_config; sys.exit(check_config())' \
  --job.config_file "$CONFIG_FILE" "$@")
STATUS=$?
set -e
if [[ $STATUS == 3 ]]; then
  mapfile -t COMMAND <<< "$INSTEAD"
  exec "${COMMAND[@]}"
fi
if [[ $STATUS != 0 ]]; then exit $STATUS; fi
exec "$PYTHON" -m torchtitan.tools.loopback_torchrun --nproc_per_node="$NGPU" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 --standalone \
  -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"
