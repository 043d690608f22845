#!/usr/bin/env bash
# Staged GPU loads of one warm checkpoint across the staged path's shapes (read method,
# readers, read size, staging limit), against the pinned host-to-device copy rate of the same
# run: which shape GpuPath::kAuto should take for a warm page cache (bench/HISTORY.md,
# "The staged path by its shape"). For the GPU machine, after scripts/gpu.sh build.
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
# Three `load --raw` runs onto cuda:0 with the flags given: their GB/s, space-separated, then
# where the last run's reader time went (seconds summed over its readers: in reads, issuing
# copies, waiting for a staging buffer).
three_runs() {
  local runs="" json
  for run in 1 2 3; do
    json=$("$cli" load "$checkpoint" --raw --device cuda:0 --json --no-progress "$@") || { runs+=" failed"; continue; }
    runs+=" $(python3 -c "import json,sys; print('%.2f' % json.loads(sys.argv[1])['gbps'])" "$json")"
  done
  echo "$runs | $(python3 -c "import json,sys; r=json.loads(sys.argv[1]); print('%.3f s: read %.2f, issue %.2f, wait %.2f' % (r['seconds'], r['read_seconds'], r['deliver_seconds'], r['staging_wait_seconds']))" "$json" 2>/dev/null)"
}
echo "| io | readers | chunk | memory limit | GB/s (3 runs) | last run, reader seconds |"
echo "| --- | ---: | ---: | ---: | --- | --- |"
for setting in "pread 16 16MiB 1GiB" "pread 8 4MiB 128MiB" "mmap 8 4MiB 128MiB" "pread 10 4MiB 160MiB" \
               "mmap 10 4MiB 160MiB" "pread 8 3MiB 96MiB" "mmap 8 3MiB 96MiB" "mmap 8 6MiB 192MiB"; do
  set -- $setting
  echo "| $1 | $2 | $3 | $4 |$(three_runs --gpu-path staged --io "$1" --concurrency "$2" --chunk-size "$3" --memory-limit "$4") |"
done
echo "| auto (default flags) | | | |$(three_runs) |"
echo "| auto, --io mmap | | | |$(three_runs --io mmap) |"
# Staged and mapped at once, the staged part in the warm shape (8 readers of 4 MiB; 2 map).
for share in 0.2 0.3; do
  echo "| both, mapped share $share | 8+2 | 4MiB | 256MiB |$(three_runs --gpu-path both --mapped-share $share --concurrency 10 --chunk-size 4MiB --memory-limit 256MiB) |"
done
[ $synthesized = 0 ] || rm -rf "$checkpoint"  # a kept checkpoint stays
