#!/usr/bin/env bash
# The GPU part of the update benchmark (issue 8), for the GPU machine: builds update_bench
# with CUDA (and NCCL when the toolkit has it) in build-gpu/, runs the transfer tests there
# (CUDA IPC must run, not skip), then a 16 GB BF16 model as ~1,000 and ~10,000 tensors
# through CUDA IPC against a device-to-device copy of the same bytes in the same run, with
# the sender's tensors shared in place and copied through buckets.
# Called by scripts/gpu.sh (stage `update`) or alone; results under $OUT (default out/gpu).
#   WS_UPDATE_BENCH_BYTES  model size (default 16GiB)
#   WS_UPDATE_BUCKET       bucket size (default 1GiB)
#   WS_UPDATE_CONFIGS      sender memory, sharing, bucket and (optional) smallest allocation
#                          shared of each row, ';'-separated (default
#                          "arena on B;arena on 256MiB;arena off B;tensors on B", B the bucket)
#   WS_UPDATE_REPEAT       updates a row (default 5)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out/gpu}
build=$root/build-gpu
jobs=${WS_JOBS:-$(nproc)}
bytes=${WS_UPDATE_BENCH_BYTES:-16GiB}
bucket=${WS_UPDATE_BUCKET:-1GiB}
configs=${WS_UPDATE_CONFIGS:-"arena on $bucket;arena on 256MiB;arena off $bucket;tensors on $bucket"}
repeat=${WS_UPDATE_REPEAT:-5}
mkdir -p "$out"
deps_flag=()
[ -d "$root/.deps/lib" ] && deps_flag=(-DWS_DEPS_DIR="$root/.deps") &&
  export LD_LIBRARY_PATH="$root/.deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
# Built by scripts/gpu.sh already (perhaps from another source folder): only the targets.
configure=(cmake -S "$root" -B "$build")
[ -f "$build/CMakeCache.txt" ] && configure=(true)
{
  "${configure[@]}" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWS_WITH_CUDA=ON -DWS_BUILD_BENCH=ON \
    "${deps_flag[@]}" && ninja -C "$build" -j "$jobs" update_bench test_transfer weightstream_cli
} >"$out/update_build.log" 2>&1 || { tail -30 "$out/update_build.log"; echo "update: build FAILED" >>"$out/summary.txt"; exit 1; }
grep "weightstream: NCCL" "$out/update_build.log" | tail -1

# Tests: the CUDA IPC audit must pass here, not skip (NCCL needs two GPUs: issue 9).
"$build/tests/test_transfer" --gtest_brief=1 >"$out/update_tests.log" 2>&1 || status=1
"$build/tests/test_transfer" --gtest_filter='AuditVia.CudaIpc*' 2>&1 | tee -a "$out/update_tests.log" |
  grep -q '\[  PASSED  \] 1 test' || { echo "cuda-ipc audit did not pass"; status=1; }
echo "update tests: $(grep -hE '^\[  (PASSED|FAILED|SKIPPED) +\]' "$out/update_tests.log" | head -3 | tr '\n' ' ')" >>"$out/summary.txt"

# The benchmark: ~1,000 and ~10,000 tensors, `repeat` updates over one connection each,
# median; the sender's tensors in one arena shared in place (the default for allocations of
# 256 MiB and more), the same arena with sharing off, and one allocation per tensor (both
# through the bucket buffers).
: >"$out/update_bench.md"
for tensors in 1000 10000; do
  IFS=';' read -ra rows <<<"$configs"
  for memory in "${rows[@]}"; do
    set -- $memory
    "$build/bench/update_bench" --device cuda:0 --bytes "$bytes" --tensors "$tensors" --bucket "$3" \
      --transports cuda-ipc --repeat "$repeat" --sender-memory "$1" --share "$2" --share-minimum "${4:-256MiB}" 2>&1 |
      tee -a "$out/update_bench.md" || status=1
    echo >>"$out/update_bench.md"
  done
done
echo "update bench: see update_bench.md ($(grep -c 'update via cuda-ipc' "$out/update_bench.md") cuda-ipc rows)" >>"$out/summary.txt"
exit $status
