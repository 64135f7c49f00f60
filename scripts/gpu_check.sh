#!/usr/bin/env bash
# The GPU path, run for real in one go (scripts/gpu_check.py says what it runs): on a machine
# with one CUDA device, 330 s of runs (stopped at 380 s by SIGTERM, which ends the run in
# progress and keeps what was measured), everything in one folder (logs and gpu_check.json).
#
#   scripts/gpu_check.sh [OUT]           # default OUT: $OUT, else outputs/gpu_check
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh /tmp/x   # the same steps on the CPU, tiny
#
# Without CUDA (and without GPU_CHECK_DRY_RUN=1) it exits at once, status 3, saying so. Python
# packages the machine lacks (torchft, tyro, ...) are installed from wheels carried in .whl/
# (no network there): /work/.library/device/README.md, "Notes", says how to fetch them. Where
# the copied tree has no .git, export GPU_CHECK_COMMIT=<commit> for the JSON's provenance.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-outputs/gpu_check}}
PY=${PYTHON:-python3}
[[ -x .venv/bin/python && -z ${PYTHON:-} ]] && PY=.venv/bin/python
dry=${GPU_CHECK_DRY_RUN:-0}
if [[ $dry != 1 ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is false with $PY): nothing to check; run it on a machine with a GPU, or set GPU_CHECK_DRY_RUN=1 to run its steps on the CPU"
  exit 3
fi
missing=$("$PY" - <<'PYEOF'
import importlib.util
names = ["torchft", "tyro", "tokenizers", "xxhash", "tensorboard", "numpy"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
PYEOF
)
if [[ -n $missing ]]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_check: installing $missing from .whl/"
    "$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl || exit 4
    export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/gpu_check_site/bin:$PATH
  else
    echo "gpu_check: this machine lacks $missing, and no wheels are in .whl/ to install them from"
    exit 4
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHON=$PY  # run_train.sh, which the launcher starts, takes it
args=(--out "$out")
[[ $dry == 1 ]] && args+=(--dry-run)
exec timeout 380 "$PY" scripts/gpu_check.py "${args[@]}"
