#!/usr/bin/env bash
# The CUDA/NCCL check (python -m vescale_plugins.tools.gpu_check): parity on CUDA at W=1 and
# W=all GPUs, the collective streams, bf16-mixed, the benchmark with CUDA memory figures,
# Triton kernels. Without CUDA it runs its CPU fallback. Every figure goes to one JSON file.
# What this adds: this checkout's code and .venv, and a hard stop that fits a short device loan.
#   scripts/gpu_check.sh [OUT.json]        (default gpu_check.json; PYTHON=... to pick one)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check.json}"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The driver spends at most 450 s on its checks; the hard stop leaves room under 8 minutes.
exec timeout -k 10 470 "$PY" -m vescale_plugins.tools.gpu_check --json "$OUT" --budget 450
