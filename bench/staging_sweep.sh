#!/usr/bin/env bash
# Staged GPU loads of one warm checkpoint across staging settings (memory limit, read size,
# readers), against the pinned host-to-device copy rate of the same run: which defaults
# the staged path should have. For the GPU machine, after scripts/gpu.sh build.
# Usage: bench/staging_sweep.sh [SIZE]   (default 16GiB); results on stdout.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cli=$root/build-gpu/weightstream
checkpoint=/tmp/ws-staging-sweep
rm -rf "$checkpoint"
"$cli" synth "$checkpoint" --arch llama --size "${1:-16GiB}" --shards 8 >/dev/null || exit 1
cat "$checkpoint"/*.safetensors >/dev/null  # warm
python3 -c "import sys; sys.path.insert(0, '$root/bench'); import gpu_bench, torch; print('pinned host-to-device copy: %.2f GB/s (median of 3, 4 GiB)' % gpu_bench.pinned_copy_rate(torch, repeats=3)['pinned'])"
echo "| memory limit | chunk | readers | GB/s (best of 2) | peak staging MiB |"
echo "| --- | --- | ---: | ---: | ---: |"
for setting in "1GiB 16MiB 16" "256MiB 16MiB 16" "128MiB 8MiB 16" "256MiB 8MiB 16" "256MiB 4MiB 16" \
               "256MiB 8MiB 32" "512MiB 8MiB 16" "128MiB 4MiB 32"; do
  set -- $setting
  best=0 staging=0
  for run in 1 2; do
    json=$("$cli" load "$checkpoint" --device cuda:0 --gpu-path staged --memory-limit "$1" --chunk-size "$2" \
      --concurrency "$3" --json --no-progress) || continue
    read -r gbps peak < <(python3 -c "import json,sys; d=json.loads(sys.argv[1]); print(d['gbps'], d['peak_staging_bytes'] >> 20)" "$json")
    if python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) > float(sys.argv[2]) else 1)" "$gbps" "$best"; then
      best=$gbps staging=$peak
    fi
  done
  printf '| %s | %s | %s | %.2f | %s |\n' "$1" "$2" "$3" "$best" "$staging"
done
rm -rf "$checkpoint"
