#!/usr/bin/env bash
# The prepared GPU run (benchmarks/gpu.py): the CUDA parity tests, eager vs CUDA-graph step
# times, many nets on one GPU, brewnet serve --gpu 0; one summary, at most 8 minutes (the
# timeout below is the hard stop). Without a CUDA GPU: one line, exit 0.
#   bash benchmarks/gpu.sh [gpu.py options]      # from anywhere; runs in the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout --kill-after=10 480 "${PYTHON:-python}" benchmarks/gpu.py --budget 465 "$@"
