#!/usr/bin/env bash
# On a GPU machine, in one call: build bik with the CUDA backend, run the whole test suite on
# the GPU (the invariance suite runs on every backend that can use the device), and benchmark.
# Writes benchmarks/results/<gpu>-<date>.{json,md,png}. Needs a CUDA build of torch installed.
# Usage: bash benchmarks/gpu_run.sh [PYTHON] [extra bench args, e.g. --quick]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
shift || true
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
BIK_BUILD_CUDA=1 "$PY" -m pip install --quiet -e ".[dev]"
"$PY" -c "import bik.backends.cuda" # fails loudly if the CUDA backend did not build
"$PY" -m pytest -q tests
gpu=$("$PY" -c "import torch; print(torch.cuda.get_device_name().lower().replace(' ', '-'))")
out="benchmarks/results/${gpu}-$(date +%F)"
"$PY" -m bik bench --device cuda --dtypes bfloat16 float32 --json "$out.json" --markdown "$out.md" \
  --plot "$out.png" "$@"
echo "wrote $out.json $out.md $out.png"
