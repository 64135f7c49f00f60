#!/usr/bin/env bash
# Fill .whl/ (in the repository root, git-ignored) with the wheels that scripts/gpu_check.sh
# installs on the GPU machine, which has Python 3.12 and torch but no network and no torchft or
# tyro: torchft and tyro and those of their requirements its image lacks, for CPython 3.12 on
# manylinux x86_64, one version of each (the versions .venv runs). Run it here (it needs pip's
# package index), then name .whl in the device call's carry:
#
#   scripts/gpu_wheels.sh        # about 4 MB; replaces whatever .whl/ held
#
# gpu_check.sh installs a carried wheel only where that machine lacks the package or has an
# older version, so typing-extensions and protobuf (there already, at a version nobody read)
# come along as a floor: typeguard needs typing-extensions >= 4.14, googleapis-common-protos
# protobuf >= 6.33.5. Check a wheel's requirements with
#   unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist
# (requests, urllib3, idna, certifi and charset-normalizer are on that machine already).
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(
  torchft==0.2.0 # pyproject.toml pins it: lighthouse and replicas must run the same version
  opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2
  opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-proto==1.45.2
  googleapis-common-protos==1.76.0
  protobuf==7.36.2
  tyro==1.0.17
  docstring-parser==0.18.0
  typeguard==4.6.1
  typing-extensions==4.16.0
)
rm -rf .whl
mkdir .whl
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${wheels[@]}"
n=$(find .whl -type f -name '*.whl' | wc -l)
if ((n != ${#wheels[@]})); then
  echo "error: scripts/gpu_wheels.sh: .whl/ holds $n wheels, ${#wheels[@]} were asked for" >&2
  exit 1
fi
echo "gpu_wheels: $n wheels, $(du -sh .whl | cut -f1) in .whl/ (carry .whl in the device call)"
