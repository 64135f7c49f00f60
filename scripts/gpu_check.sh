#!/usr/bin/env bash
# The GPU path, run for real in one go (scripts/gpu_check.py says what it measures, and
# scripts/gpu_check_runs.py lists the runs), on a machine with one CUDA device, or two with
# --gpus 2 (replica groups over nccl, one killed); everything in one folder (a log per run and
# gpu_check.json, written after every run; its `covers` says what one GPU cannot show).
#
#   scripts/gpu_check.sh [--gpus 2] [OUT]   # default OUT: $OUT, else outputs/gpu_check
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh [--gpus 2] /tmp/x   # the same steps on the CPU, tiny
#
# Time, with one GPU or two: the whole of it, wheel installation included, ends within
# GPU_CHECK_HARD_S (345 s). What the installation leaves goes to `timeout` (SIGTERM, then SIGKILL
# 20 s later); the runs get 30 s less than that (--budget-s, at most 295 s), which leaves room
# for stopping the run in progress (15 s) and writing the JSON. Each run's own timeout is
# bounded by what is left, and the runs' timeouts of each list add up to less than the budget
# (scripts/gpu_check_runs.py). A lease of 15 minutes of device time fits the check twice after
# one machine start: ~120 s to start + 2 x 345 s = 810 s < 900 s (give the device call
# timeout_s 360).
#
# Without CUDA, or with --gpus 2 and fewer than 2 GPUs (and without GPU_CHECK_DRY_RUN=1), it
# exits at once, status 3, saying so. Python
# packages the machine lacks (torchft, tyro, ...) are installed from wheels carried in .whl/
# (no network there), which scripts/gpu_wheels.sh fetches beforehand. Where
# the copied tree has no .git, export GPU_CHECK_COMMIT=<commit> for the JSON's provenance.
set -uo pipefail
SECONDS=0
hard_s=${GPU_CHECK_HARD_S:-345}
gpus=1
if [[ ${1:-} == --gpus ]]; then
  gpus=${2:-}
  shift 2 || true
fi
if [[ $gpus != 1 && $gpus != 2 ]]; then
  echo "gpu_check: --gpus ${gpus:-(missing)} is not allowed; use --gpus 1 or --gpus 2"
  exit 2
fi
cd "$(dirname "$0")/.."
out=${1:-${OUT:-outputs/gpu_check}}
PY=${PYTHON:-python3}
[[ -x .venv/bin/python && -z ${PYTHON:-} ]] && PY=.venv/bin/python
dry=${GPU_CHECK_DRY_RUN:-0}
if [[ $dry != 1 ]]; then
  count=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
  if ((count == 0)); then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is false with $PY): nothing to check; run it on a machine with a GPU, or set GPU_CHECK_DRY_RUN=1 to run its steps on the CPU"
    exit 3
  elif ((count < gpus)); then
    echo "gpu_check: --gpus $gpus needs $gpus CUDA devices; torch sees $count here: nothing to check; run it on a machine with $gpus GPUs, or set GPU_CHECK_DRY_RUN=1 to run its steps on the CPU"
    exit 3
  fi
fi
# The wheels in .whl/ (scripts/gpu_wheels.sh fetches them): each one whose package this
# interpreter lacks, or has at an older version, goes to /tmp/gpu_check_site, put first on
# PYTHONPATH. Packages it has at that version or newer stay as they are.
if compgen -G ".whl/*.whl" >/dev/null; then
  mapfile -t need < <("$PY" - .whl/*.whl <<'PYEOF'
import importlib.metadata as md
import os
import sys

try:
    from packaging.version import Version
except ImportError:  # then only the missing ones
    Version = None
for path in sys.argv[1:]:
    name, version = os.path.basename(path).split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        print(path)
        continue
    if Version is not None and Version(have) < Version(version):
        print(path)
PYEOF
  )
  if ((${#need[@]})); then
    echo "gpu_check: installing ${#need[@]} wheels from .whl/: ${need[*]#.whl/}"
    "$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile \
      --target /tmp/gpu_check_site "${need[@]}" || exit 4
    export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/gpu_check_site/bin:$PATH
  fi
fi
missing=$("$PY" - <<'PYEOF'
import importlib.util
names = ["torchft", "tyro", "typeguard", "docstring_parser", "opentelemetry.sdk", "tokenizers",
         "xxhash", "tensorboard", "numpy"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
PYEOF
)
if [[ -n $missing ]]; then
  echo "gpu_check: $PY lacks $missing: scripts/gpu_wheels.sh puts torchft's and tyro's wheels" \
    "in .whl/ (carry .whl); the others are on the GPU machine's image"
  exit 4
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHON=$PY  # run_train.sh, which the launcher starts, takes it
limit_s=$((hard_s - SECONDS - 20))  # SIGTERM then; SIGKILL 20 s later, at the hard limit
budget_s=$((limit_s - 30 < 295 ? limit_s - 30 : 295))
if ((budget_s < 30)); then
  echo "gpu_check: only $limit_s s left of $hard_s s after installing: too little to run"
  exit 5
fi
args=(--out "$out" --budget-s "$budget_s" --gpus "$gpus")
[[ $dry == 1 ]] && args+=(--dry-run)
exec timeout -k 20 "$limit_s" "$PY" scripts/gpu_check.py "${args[@]}"
