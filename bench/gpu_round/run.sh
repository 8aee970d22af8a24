#!/usr/bin/env bash
# One GPU round: `bash bench/gpu_round/run.sh decode:300 largem:240 ...` runs each area's stages (bench/gpu_round/
# AREA.sh) in the order given, inside the area's time limit, logs under $OUT/AREA/. A failing stage is logged and the
# round goes on: one broken opt-in must not cost the other areas their device time.
# DRY=1 (on the CPU machine): run nothing, check instead that every stage's script and flags exist and every pytest
# selection collects tests (`DRY=1 bash bench/gpu_round/run.sh all`).
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/gpu_round} PYTHONUNBUFFERED=1 DRY=${DRY:-0}
here=bench/gpu_round
if [ "$DRY" != 1 ]; then  # peers + gguf from the carried wheels; the image has torch, triton, transformers
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site bench_out/whl/*.whl || true
  export PYTHONPATH=$PWD:/tmp/site
  git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader || true
fi
source $here/lib.sh
[ "${1:-}" = all ] && set -- decode:9999 largem:9999 moe:9999 w8a8:9999 spec:9999
for item in "$@"; do
  AREA=${item%%:*}; AREA_END=$(( $(date +%s) + ${item#*:} ))
  mkdir -p "$OUT/$AREA"
  echo "=== $AREA (limit ${item#*:} s) $(date -u +%H:%M:%S)"
  source "$here/$AREA.sh"
done
echo "=== done $(date -u +%H:%M:%S); dry-run problems: ${DRY_FAILS:-0}"
[ "${DRY_FAILS:-0}" = 0 ]
