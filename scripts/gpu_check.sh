#!/usr/bin/env bash
# The device check (python -m vescale_plugins.tools.gpu_check; docs/gpu_check.md): parity on
# CUDA against FSDP2 and the unsharded model, several ranks on one GPU, race provocation, the
# optimizers with no host sync, the Triton kernel, the reduce-scatter wait, a training step of
# both engines captured in a CUDA graph (reported, never failed), both engines' memory.
# Without CUDA it runs its CPU fallback. Writes OUT/gpu_check.json, OUT/parts.jsonl (one JSON
# record a part) and OUT/summary.txt (one line a part).
#   scripts/gpu_check.sh [OUT]        (default gpu_check_out; an OUT ending in .json is the report's path)
# Nothing is installed: this checkout runs from source (PYTHONPATH) on the torch of the Python
# chosen here: $PYTHON, else this checkout's .venv, else python3 (the device machine's, which
# holds its torch and Triton), else python. The package supports the device's torch 2.11 as it
# is (torch>=2.11,<2.16); the report records the version.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check_out}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
elif command -v python3 >/dev/null; then PY=python3
else PY=python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
case "$OUT" in
  *.json) WHERE=(--json "$OUT") ;;
  *) WHERE=(--out "$OUT") ;;
esac
# The parts share 450 s (each also has its own budget); the hard stop leaves room under 8 minutes.
exec timeout -k 10 470 "$PY" -m vescale_plugins.tools.gpu_check "${WHERE[@]}" --budget 450
