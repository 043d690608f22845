#!/usr/bin/env bash
# One device call's driver: runs scripts/gpu.sh stages one after another inside a deadline,
# each stage given at most what is left (or its own limit), each stage's files under
# $OUT/r/STAGE/, then packs them into one file, $OUT/gpu-run.tgz (the device tool returns at
# most 8 files, and a call it stops at its limit returns only what is already under $OUT). A
# stage that is not reached is listed as skipped in r/steps.txt.
#
# Usage: scripts/gpu-run.sh STAGE[:SECONDS]...    e.g. build python ranks:150 ucx:150 pythonpath
#   WS_GPU_DEADLINE  seconds for all stages together (default 540, inside a 600 s call)
#   the environment of scripts/gpu.sh (WS_GPU_MOE_ROWS, WS_GPU_SOURCE, ...) passes through
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out/gpu-run}
logs=$out/r
mkdir -p "$logs"
deadline=${WS_GPU_DEADLINE:-540}
start=$SECONDS
for spec in "$@"; do
  stage=${spec%%:*}
  limit=${spec#*:}
  [ "$limit" = "$spec" ] && limit=$deadline
  left=$((deadline - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then
    echo "$stage: skipped (deadline)" >>"$logs/steps.txt"
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  began=$SECONDS
  mkdir -p "$logs/$stage"
  OUT=$logs/$stage timeout "$limit" bash "$root/scripts/gpu.sh" "$stage" >"$logs/$stage/stage.log" 2>&1
  echo "$stage: rc $? in $((SECONDS - began)) s (limit $limit s)" >>"$logs/steps.txt"
done
cat "$logs/steps.txt"
tar -czf "$out/gpu-run.tgz" -C "$out" r && rm -rf "$logs"
