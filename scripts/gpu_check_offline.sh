#!/usr/bin/env bash
# The GPU check on a host that has only torch: joins a wheelhouse cut into parts (see docs/gpu-check.md), installs it
# offline beside the host's torch and runs benchmarks/gpu_check.py from this checkout, its summary as JSON in $OUT.
#   bash scripts/gpu_check_offline.sh [PARTS_DIR] [gpu_check.py arguments ...]
set -euo pipefail
cd "$(dirname "$0")/.."
parts=${1:-wheelhouse/parts}
shift || true
python=${PYTHON:-python3}
into=$(mktemp -d)
cat "$parts"/wh.tar.* | tar -x -C "$into"
bash "$into"/*/install.sh --python "$python"
"$python" benchmarks/gpu_check.py --json "${OUT:-.}/gpu_check.json" "$@"
