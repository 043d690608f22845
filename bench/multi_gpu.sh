#!/usr/bin/env bash
# Issue 9's runs, for a machine with two GPUs (the device tool's nvidia-h200-x2), from the
# repository root after `scripts/gpu.sh build` (which builds update_bench with NCCL).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, as the machine sets it).
#   1. Update broadcast: a trainer process on cuda:0 sends a 16 GB bf16 model in buckets over
#      NCCL to a receiver on cuda:1 (a LoadSession in update mode; every parameter checked
#      after), against NCCL's own broadcast of the same bytes in one buffer (torch), same
#      run; then the audit through NCCL (cold load, reload by a second process, clean).
#   2. Distributed cold load: two tensor-parallel ranks at once, each reading only its own
#      byte ranges (`load --tp-size 2 --tp-rank R --device cuda:R`), against each rank reading
#      the whole checkpoint at once (`load --raw`). Not implemented yet: ranks that read half
#      of the shared tensors each and exchange them over NCCL.
# Results under $OUT (default out/multi_gpu). Usage: bench/multi_gpu.sh [SIZE] (default 16GiB)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=$root/build-gpu
out=${OUT:-$root/out/multi_gpu}
size=${1:-16GiB}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
[ -d "$root/.deps/lib" ] && [ ! -L "$root/.deps/lib/libcurl.so" ] && export LD_LIBRARY_PATH="$root/.deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
gpus=$(nvidia-smi --list-gpus | wc -l)
[ "$gpus" -ge 2 ] || { echo "multi_gpu.sh needs two GPUs; this machine has $gpus"; exit 1; }
status=0

{
  echo "## 1. Update broadcast over NCCL, cuda:0 -> cuda:1, $size"
  echo
  "$build/bench/update_bench" --device cuda:1 --sender-device cuda:0 --bytes "$size" --tensors 1000 --bucket 1GiB \
    --transports nccl --repeat 3 || status=1
  python3 bench/nccl_broadcast.py --bytes "$size" --repeat 3 || status=1
  echo
  "$build/tests/test_transfer" --gtest_filter='AuditVia.Nccl*' --gtest_brief=1 2>&1 | tail -3
} 2>&1 | tee "$out/broadcast.md"

checkpoint=/tmp/ws-multi-gpu
rm -rf "$checkpoint"
"$build/weightstream" synth "$checkpoint" --arch llama --size "$size" --shards 8 >/dev/null || exit 1
cat "$checkpoint"/*.safetensors >/dev/null  # warm
both_ranks() {  # label, then the load flags after the URI; {rank} is replaced per rank
  local label=$1; shift
  local start=$SECONDS pids=() rank
  for rank in 0 1; do
    "$build/weightstream" load "$checkpoint" "${@//\{rank\}/$rank}" --json --no-progress >"$out/load_$rank.json" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  python3 - "$label" "$out/load_0.json" "$out/load_1.json" <<'PY'
import json, sys
label, runs = sys.argv[1], [json.load(open(path)) for path in sys.argv[2:]]
read = sum(r.get("bytes_read", r.get("bytes", 0)) for r in runs)
slowest = max(r["seconds"] for r in runs)
print(f"| {label} | {slowest:.2f} | {read / 1e9:.1f} | " + " / ".join(f"{r['gbps']:.1f}" for r in runs) + " |")
PY
}
{
  echo
  echo "## 2. Distributed cold load, two ranks at once, $size llama (page cache warm)"
  echo
  echo "| what | seconds (slower rank) | GB read by both | GB/s per rank |"
  echo "| --- | ---: | ---: | --- |"
  both_ranks "each rank reads only its byte ranges (tp 2)" --tp-size 2 --tp-rank "{rank}" --device "cuda:{rank}"
  both_ranks "each rank reads everything (raw load)" --device "cuda:{rank}"
} 2>&1 | tee "$out/distributed_load.md"
rm -rf "$checkpoint"
exit $status
