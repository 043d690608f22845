#!/usr/bin/env bash
# Staged GPU loads of one warm checkpoint across the staged path's shapes (read method,
# readers, read size, staging limit), against the pinned host-to-device copy rate of the same
# run: which shape GpuPath::kAuto should take for a warm page cache (bench/RESULTS.md,
# session 7). For the GPU machine, after scripts/gpu.sh build.
# Usage: bench/staging_sweep.sh [CHECKPOINT_DIR | SIZE]
#   a directory: that checkpoint (e.g. gpu_bench.py's kept /tmp/ws-gpu-bench), read once to warm it;
#   else a synth llama checkpoint of SIZE (default 16GiB). Results on stdout, 3 runs a row.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cli=$root/build-gpu/weightstream
synthesized=0
if [ -d "${1:-}" ]; then
  checkpoint=$1
else
  synthesized=1
  checkpoint=/tmp/ws-staging-sweep
  rm -rf "$checkpoint"
  "$cli" synth "$checkpoint" --arch llama --size "${1:-16GiB}" --shards 8 >/dev/null || exit 1
fi
cat "$checkpoint"/*.safetensors >/dev/null  # warm
python3 -c "import sys; sys.path.insert(0, '$root/bench'); import gpu_bench, torch; print('pinned host-to-device copy: %.2f GB/s (median of 3, 4 GiB)' % gpu_bench.pinned_copy_rate(torch, repeats=3)['pinned'])"
# Three `load --raw` runs onto cuda:0 with the flags given: their GB/s, space-separated.
three_runs() {
  local runs="" json
  for run in 1 2 3; do
    json=$("$cli" load "$checkpoint" --raw --device cuda:0 --json --no-progress "$@") || { runs+=" failed"; continue; }
    runs+=" $(python3 -c "import json,sys; print('%.2f' % json.loads(sys.argv[1])['gbps'])" "$json")"
  done
  echo "$runs"
}
echo "| io | readers | chunk | memory limit | GB/s (3 runs) |"
echo "| --- | ---: | ---: | ---: | --- |"
for setting in "pread 16 16MiB 1GiB" "pread 8 4MiB 128MiB" "mmap 8 4MiB 128MiB" "pread 8 2MiB 64MiB" "mmap 8 2MiB 64MiB" \
               "pread 8 1MiB 32MiB" "mmap 8 1MiB 32MiB" "pread 4 4MiB 64MiB" "mmap 4 4MiB 64MiB" \
               "pread 6 4MiB 96MiB" "mmap 6 4MiB 96MiB" "pread 12 4MiB 192MiB" "mmap 12 4MiB 192MiB" \
               "mmap 8 8MiB 256MiB"; do
  set -- $setting
  echo "| $1 | $2 | $3 | $4 |$(three_runs --gpu-path staged --io "$1" --concurrency "$2" --chunk-size "$3" --memory-limit "$4") |"
done
echo "| auto (default flags) | | | |$(three_runs) |"
echo "| auto, --io mmap | | | |$(three_runs --io mmap) |"
[ $synthesized = 0 ] || rm -rf "$checkpoint"  # a kept checkpoint stays
