#!/usr/bin/env bash
# One short GPU-machine run for the benchmark tables when little device time is left:
# build with CUDA, then on one checkpoint with a warm page cache
#   * `weightstream load --device cuda:0` by each GPU path against the pinned host-to-device
#     copy rate measured in the same run (issue 4), and
#   * bench/cpu_bench.py on two cores (taskset) against dd, safetensors and the Run:ai
#     streamer, whose wheels travel in .whl/ (issue 2).
# Results under $OUT. Usage: bench/device_final.sh [SIZE]   (default 8GiB)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/out/final}
mkdir -p "$out"
size=${1:-8GiB}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
scripts/gpu.sh build >"$out/build.txt" 2>&1 || { tail -30 "$out/build.txt"; exit 1; }
cli=$root/build-gpu/weightstream
ckpt=/tmp/ws-final
rm -rf "$ckpt"
"$cli" synth "$ckpt" --arch llama --size "$size" --shards 8 --hidden 4096 --dtype f16 | tee "$out/gpu.txt"
cat "$ckpt"/*.safetensors >/dev/null
python3 -c "import sys; sys.path.insert(0, '$root/bench'); import gpu_bench, torch; print('pinned host-to-device copy: %.2f GB/s (median of 3, 4 GiB)' % gpu_bench.pinned_copy_rate(torch, repeats=3)['pinned'])" 2>&1 | tee -a "$out/gpu.txt"
for run in "staged 1GiB" "staged 256MiB" "staged 256MiB" "mapped 1GiB"; do
  set -- $run
  "$cli" load "$ckpt" --device cuda:0 --gpu-path "$1" --memory-limit "$2" --json --no-progress >"$out/load.json" 2>&1 &&
    python3 -c "import json; d=json.load(open('$out/load.json')); print('weightstream load cuda:0 $1 limit $2: %.2f GB/s, %.2f s, peak staging %d MiB' % (d['gbps'], d['seconds'], d['peak_staging_bytes'] >> 20))" |
    tee -a "$out/gpu.txt"
done
"$root/build-gpu/tests/test_transfer" --gtest_filter='AuditVia.CudaIpc*' --gtest_brief=1 2>&1 | tail -3 | tee -a "$out/gpu.txt"
[ "${WS_FINAL_CPU_BENCH:-1}" = 1 ] && taskset -c 0,1 python3 bench/cpu_bench.py "$ckpt" --cli "$cli" --repeat 2 --out "$out" 2>&1 | tail -12 | tee "$out/cpu.txt"
rm -rf "$ckpt"
