#!/usr/bin/env bash
# Set up .venv if needed, then run the demo: a torchft lighthouse plus 2 replica groups training
# the debug Llama on the embedded corpus on CPU with DiLoCo (sync every 20 inner steps), 120
# steps (6 syncs). Extra args go to every group's run_train.sh, e.g.
# scripts/demo.sh --training.steps=400
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh run  # training's dependencies only: the demo needs no test tools
exec ./run_launcher.sh --groups 2 -- \
  --job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config \
  --fault_tolerance.semi_sync_method=diloco --fault_tolerance.sync_steps=20 \
  --training.steps=120 --validation.freq=40 --job.dump_folder=./outputs/demo "$@"
