#!/usr/bin/env bash
# Everything weightstream checks on a GPU machine, in one run from the repository root:
# build with CUDA, run the whole test suite (the CUDA tests run here instead of skipping),
# check that digests of bytes landed on the GPU equal the host digests, and run the GPU
# load benchmark (bench/gpu_bench.py, below). Logs and results go under $OUT (default out/gpu).
#
# The GPU machine has the CUDA toolkit, CMake, ninja and PyTorch but none of our -dev
# packages and no registry: scripts/gpu-deps.sh, run beforehand on a machine that has
# them, fills .deps/, which travels with the tree and is found through WS_DEPS_DIR.
#
# Usage: scripts/gpu.sh [build|test|digest|pinned|probe|python|bench|layout|sweep|smallload|update|families|audits|gdn|moe|ucx|pythonpath|ranks|all]...   (default: all)
#   WS_GPU_MOE_SIZE        the FP8 MoE checkpoint of the moe stage (default 8GiB)
#   WS_GPU_MOE_ROWS        its rows, comma-separated (default all: raw,tp2,ep,host,update,update_gpu,update_local,audit)
#   WS_GPU_UCX_SIZE        the checkpoint of the ucx stage (default 4GiB)
#   WS_GPU_BENCH_SECTIONS  sections of bench/gpu_bench.py for the bench stage (default all)
#   WS_GPU_BENCH_DIR       its checkpoint, kept between calls (default /tmp/ws-gpu-bench)
#   WS_GPU_BENCH_ARGS      more flags for it (--peers, --repeats, --cold-repeats, ...)
#   WS_JOBS             build and test parallelism (default: the core count)
#   WS_GPU_BUILD_TARGETS   ninja targets of the build stage (default all; e.g. weightstream
#                          alone when a short call needs only the command)
#   WS_GPU_PYTHON_TESTS    1 (default): the python stage runs every Python test; gpu: only
#                          those that use the GPU (test_bind_gpu.py, and the tests named for
#                          cuda or gpu elsewhere; CI runs the rest on every commit); 0: none
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/out/gpu}
build=$root/build-gpu
deps=$root/.deps
jobs=${WS_JOBS:-$(nproc)}
mkdir -p "$out"
: >"$out/summary.txt"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(all)
wants() { for stage in "${stages[@]}"; do [ "$stage" = all ] || [ "$stage" = "$1" ] && return 0; done; return 1; }
status=0
summary() { echo "$*" >>"$out/summary.txt"; }

# libcurl and OpenSSL: where the GPU machine has them (runtime libraries, no headers), link
# and run against its own, so no copy from .deps/ is ever loaded into a process that also
# loads torch or Python's ssl module (two OpenSSL builds in one process abort in free()).
system_library() { ldconfig -p | awk -v name="$1" '$1 == name && /x86-64/ {print $NF; exit}'; }
use_system_tls=0
if [ -d "$deps/lib" ] && [ -n "$(system_library libcurl.so.4)" ] && [ -n "$(system_library libssl.so.3)" ] &&
  [ -n "$(system_library libcrypto.so.3)" ]; then
  use_system_tls=1
  for name in curl ssl crypto; do
    soname=lib$name.so.$([ $name = curl ] && echo 4 || echo 3)
    rm -f "$deps/lib/lib$name.so" "$deps/lib/$soname"
    ln -s "$(system_library "$soname")" "$deps/lib/lib$name.so"
  done
fi
if [ -d "$deps/lib" ]; then
  if [ $use_system_tls = 1 ]; then
    echo "libcurl and OpenSSL: the system's ($(system_library libcurl.so.4), $(system_library libssl.so.3))"
  else
    echo "libcurl and OpenSSL: .deps/lib's copies, on LD_LIBRARY_PATH"
    export LD_LIBRARY_PATH="$deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  deps_flag=(-DWS_DEPS_DIR="$deps")
else
  echo "no .deps/ (scripts/gpu-deps.sh makes it): using the system's libraries"
  deps_flag=()
fi

# A CUDA-aware UCX (scripts/gpu-deps.sh packs the libucx-cu13 wheel's files into .deps/): the
# build links it (peers and the ucx update transport then move GPU memory: cuda_ipc,
# cuda_copy), and its ucx_perftest is the ucx stage's baseline.
ucx_flags=()
if [ -f "$deps/ucx-cu13.tar.xz" ]; then
  ucx_root=/tmp/ucx-cu13
  [ -d "$ucx_root/libucx" ] || { mkdir -p "$ucx_root" && tar -xJf "$deps/ucx-cu13.tar.xz" -C "$ucx_root"; }
  ucx_flags=(-DWS_WITH_UCX=ON -DUCX_INCLUDE_DIR="$ucx_root/libucx/include"
    -DUCX_UCP_LIBRARY="$ucx_root/libucx/lib/libucp.so" -DUCX_UCS_LIBRARY="$ucx_root/libucx/lib/libucs.so")
  export LD_LIBRARY_PATH="$ucx_root/libucx/lib:$ucx_root/libucx_cu13.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PATH="$ucx_root/libucx/bin:$PATH"
  echo "UCX: $(ucx_info -v 2>&1 | head -2 | tr '\n' ' ')"
else
  echo "no .deps/ucx-cu13.tar.xz (scripts/gpu-deps.sh makes it): built without UCX"
fi

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1
  nvcc --version | tail -1
  cmake --version | head -1
  grep PRETTY_NAME /etc/os-release
  echo "cores $(nproc), memory $(free -g | awk '/Mem:/ {print $2}') GiB"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

configure_and_build() {  # source folder
  cmake -S "$1" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWS_WITH_CUDA=ON -DWS_BUILD_BENCH=ON "${deps_flag[@]}" "${ucx_flags[@]}" >>"$out/build.log" 2>&1 &&
    ninja -C "$build" -j "$jobs" ${WS_GPU_BUILD_TARGETS:-} >>"$out/build.log" 2>&1
}
# What is built: the working tree, or WS_GPU_SOURCE (a folder holding an export of one
# commit, e.g. `git archive HEAD`, for a working tree that others are editing), or HEAD
# when the tree does not build.
source_dir=${WS_GPU_SOURCE:-$root}
[ -f "$build/CMakeCache.txt" ] && source_dir=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")
if wants build; then
  start=$SECONDS
  source_dir=$(cd "${WS_GPU_SOURCE:-$root}" && pwd)
  : >"$out/build.log"
  if configure_and_build "$source_dir"; then
    summary "build: ok in $((SECONDS - start)) s"
  elif [ -z "${WS_GPU_SOURCE:-}" ] && git -C "$root" rev-parse -q --verify HEAD >/dev/null 2>&1; then
    # A shared working tree can hold someone's half-written file: build the last commit.
    tail -20 "$out/build.log"
    echo "the working tree does not build; building HEAD ($(git -C "$root" rev-parse --short HEAD)) instead"
    rm -rf "$build" "$root/build-gpu-head" && mkdir -p "$root/build-gpu-head"
    git -C "$root" archive HEAD | tar -x -C "$root/build-gpu-head"
    source_dir=$root/build-gpu-head
    if configure_and_build "$source_dir"; then
      summary "build: the working tree failed; HEAD $(git -C "$root" rev-parse --short HEAD) built in $((SECONDS - start)) s"
    else
      tail -40 "$out/build.log"
      summary "build: FAILED (see build.log)"
      exit 1
    fi
  else
    tail -40 "$out/build.log"
    summary "build: FAILED (see build.log)"
    exit 1
  fi
fi

if wants test; then
  start=$SECONDS
  # No S3 server here (moto is not installed): those tests skip and say so.
  (cd "$build" && ctest -j "$jobs" --timeout 300 --output-on-failure) >"$out/ctest.log" 2>&1 || status=1
  summary "tests: $(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -1)" \
    "($(grep -c '\*\*\*Skipped' "$out/ctest.log") skipped)"
  grep -A200 "The following tests FAILED" "$out/ctest.log" | head -40
  # The CUDA tests must have run, not skipped.
  "$build/tests/test_device" --gtest_filter='Cuda.*' --gtest_brief=1 >"$out/cuda_tests.log" 2>&1 || status=1
  "$build/tests/test_load" --gtest_filter='*Cuda*' --gtest_brief=1 >>"$out/cuda_tests.log" 2>&1 || status=1
  # FP8 block quantization on the GPU: the kernel against the host quantizer, an update into GPU parameters.
  "$build/tests/test_model" --gtest_filter='CudaFp8*' --gtest_brief=1 >>"$out/cuda_tests.log" 2>&1 || status=1
  summary "cuda tests ($((SECONDS - start)) s for all tests):" \
    "$(grep -hE '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$out/cuda_tests.log" | tr '\n' ' ')"
fi

if wants digest; then
  # sha256 of every tensor of a small llama checkpoint: host, then landed on cuda:0 by each path.
  # (Few files under $OUT: the device tool brings back at most 8.)
  scratch=$(mktemp -d)
  "$build/weightstream" synth "$scratch/ckpt" --arch llama --size 256MiB --shards 3 >/dev/null
  "$build/weightstream" digest "$scratch/ckpt" --device cpu --no-progress >"$scratch/cpu.txt"
  result="digest: cuda:0 vs cpu (sha256, $(wc -l <"$scratch/cpu.txt") tensors):"
  for path in auto staged mapped; do  # auto: the warm shape, read through a mapping (just written: warm)
    "$build/weightstream" digest "$scratch/ckpt" --device cuda:0 --gpu-path "$path" --no-progress >"$scratch/$path.txt" &&
      cmp -s "$scratch/cpu.txt" "$scratch/$path.txt" && result+=" $path equal" || { result+=" $path DIFFER"; status=1; }
  done
  summary "$result"
  rm -rf "$scratch"
fi

# ---- the GPU load benchmark (issues 4, 16 and 19): bench/gpu_bench.py ----------------------
# One run of every contender on a 16.06 GB Llama-3-8B-shaped checkpoint written by the
# safetensors package, in sections: WS_GPU_BENCH_SECTIONS (default all = write, baselines,
# warm, layout, python, peers, interleaved, cold; interleaved re-measures the rows of issue
# 19's ratios round-robin). The checkpoint and the results so far stay in
# WS_GPU_BENCH_DIR (default /tmp/ws-gpu-bench) between calls on the same machine, so the
# sections can run as several calls, each under its own time limit; every call rewrites
# $out/gpu_bench.md and gpu_bench.json with all rows so far. The `layout` stage is the issue 16
# subset (baselines, warm, layout, python). The peers come as wheels in .whl/ (installed into
# /tmp/peer-site, on the peers' PYTHONPATH only). WS_GPU_BENCH_ARGS adds flags (e.g.
# "--peers runai,instanttensor --repeats 5").
run_gpu_bench() {  # sections
  local site=$build/python-site peer_site=/tmp/peer-site
  if compgen -G "$root/.whl/*.whl" >/dev/null; then
    # By name from .whl/, so pip takes the one wheel of each peer that fits this python (.whl/
    # may hold cp311, cp312 and cp313 builds of one version).
    python3 -m pip install -q --no-index --find-links "$root/.whl" --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$peer_site" $(ls "$root"/.whl/*.whl | xargs -n1 basename | cut -d- -f1 | sort -u) \
      >>"$out/bench.log" 2>&1 || echo "installing the wheels in .whl/ failed (see bench.log)"
  else
    echo "no .whl/ folder of peer wheels: the Run:ai, fastsafetensors and InstantTensor rows will fail"
  fi
  # shellcheck disable=SC2086  # WS_GPU_BENCH_ARGS is a list of flags
  PYTHONUNBUFFERED=1 python3 bench/gpu_bench.py --cli "$build/weightstream" --out "$out" \
    --dir "${WS_GPU_BENCH_DIR:-/tmp/ws-gpu-bench}" --keep --sections "$1" --peer-site "$peer_site" \
    $([ -d "$site/weightstream" ] && echo --python-site "$site") ${WS_GPU_BENCH_ARGS:-} 2>&1 | tee -a "$out/bench.log" ||
    status=1
  summary "gpu bench ($1): $(grep -c '\*\*met\*\*' "$out/gpu_bench.md" 2>/dev/null) targets met," \
    "$(grep -c '\*\*MISSED\*\*' "$out/gpu_bench.md" 2>/dev/null) missed," \
    "$(grep -c ': not measured' "$out/gpu_bench.md" 2>/dev/null) not measured (gpu_bench.md)"
}
if wants bench; then
  run_gpu_bench "${WS_GPU_BENCH_SECTIONS:-all}"
elif wants layout; then
  run_gpu_bench baselines,warm,layout,python
fi

if wants sweep; then
  # Issue 19: the staged path by its shape (read method, readers, read size, staging) and the
  # default auto, on the benchmark's kept checkpoint where there is one (bench/staging_sweep.sh).
  checkpoint=${WS_GPU_BENCH_DIR:-/tmp/ws-gpu-bench}
  [ -d "$checkpoint" ] || checkpoint=16GiB
  bench/staging_sweep.sh "$checkpoint" 2>&1 | tee "$out/sweep.md" || status=1
  summary "sweep: $(grep -c '^| [a-z]' "$out/sweep.md") rows in sweep.md"
fi

if wants smallload; then
  # Issue 20's small-load floor on this machine's idle CPUs: 20 loads of a 30 MiB checkpoint,
  # in-process time, how many stay under 20 ms (bench/HISTORY.md, "Small-load floor").
  python3 bench/small_load_bench.py --cli "$build/weightstream" 2>&1 | tee "$out/small_load.md" | tee -a "$out/summary.txt" ||
    status=1
fi

if wants pinned; then
  # How long pinning 1 GiB takes each way (the staged path allocates its staging in the load).
  python3 bench/pinned_probe.py 2>&1 | tee -a "$out/summary.txt" || status=1
fi

if wants probe; then
  # Issue 19: what bounds a warm load (pread, memcpy, registration, DMA, staged and mapped
  # pipelines alone and together), on 8 GiB of files in the page cache.
  probe_dir=$(mktemp -d)
  "$build/bench/host_path_probe" --dir "$probe_dir" --files 8 --file-gib 1 2>&1 | tee "$out/probe.txt" || status=1
  # The loader itself on an 8 GiB synth checkpoint, by path and reader count, beside the probe.
  "$build/weightstream" synth "$probe_dir/ckpt" --arch llama --size 8GiB --shards 4 >/dev/null 2>&1
  cat "$probe_dir"/ckpt/*.safetensors >/dev/null
  for path in auto staged mapped; do  # auto: the warm shape, read through a mapping (just written: warm)
    for concurrency in 16 24; do
      for run in 1; do
        "$build/weightstream" load "$probe_dir/ckpt" --raw --device cuda:0 --gpu-path $path --concurrency $concurrency \
          --no-progress --json 2>&1 | python3 -c "import json,sys; r=json.load(sys.stdin); print('load: $path c=$concurrency run $run', round(r['seconds'],3), 's', round(r['bytes']/r['seconds']/1e9,2), 'GB/s')" \
          2>&1 | tee -a "$out/probe.txt"
      done
    done
  done
  rm -rf "$probe_dir"
  summary "probe: $(grep -c '^probe:' "$out/probe.txt") probe lines, $(grep -c '^load:' "$out/probe.txt") load lines in probe.txt"
fi

if wants python; then
  # The Python package (issue 6) built here against this machine's torch-bearing Python,
  # then its tests with torch and a GPU present, and both import orders of torch and us.
  start=$SECONDS
  site=$build/python-site
  rm -rf "$site"
  if CMAKE_ARGS="-DWS_WITH_CUDA=ON ${deps_flag[*]} ${ucx_flags[*]}" CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
    python3 -m pip install --no-build-isolation --no-deps --no-cache-dir -q --target "$site" \
    --config-settings=build-dir="$build/python-build" "$source_dir" >"$out/python.log" 2>&1; then
    ldd "$site"/weightstream/_core*.so | grep -E 'curl|ssl|crypto|ffi|stdc' >>"$out/python.log"
    imports=""
    for order in "weightstream, torch" "torch, weightstream"; do
      PYTHONPATH="$site" python3 -c "import $order; torch.ones(1, device='cuda:0'); print('ok')" >>"$out/python.log" 2>&1 &&
        imports+=" [$order: ok]" || { imports+=" [$order: FAILED rc $?]"; status=1; }
    done
    if [ "${WS_GPU_PYTHON_TESTS:-1}" = 1 ]; then
      WS_CLI="$build/weightstream" PYTHONPATH="$site" python3 -m pytest -q -rs -p no:cacheprovider "$source_dir/tests/python" \
        >>"$out/python.log" 2>&1 || status=1
    elif [ "${WS_GPU_PYTHON_TESTS}" = gpu ]; then
      WS_CLI="$build/weightstream" PYTHONPATH="$site" python3 -m pytest -q -rs -p no:cacheprovider \
        "$source_dir/tests/python/test_bind_gpu.py" >>"$out/python.log" 2>&1 || status=1
      WS_CLI="$build/weightstream" PYTHONPATH="$site" python3 -m pytest -q -rs -p no:cacheprovider -k "cuda or gpu" \
        --ignore="$source_dir/tests/python/test_bind_gpu.py" "$source_dir/tests/python" >>"$out/python.log" 2>&1 || status=1
    else
      echo "pytest: not run (WS_GPU_PYTHON_TESTS=0)" >>"$out/python.log"
    fi
    summary "python ($((SECONDS - start)) s): imports$imports; pytest: $(grep -E '[0-9]+ (passed|failed)' "$out/python.log" | tr '\n' ' ')"
  else
    tail -30 "$out/python.log"
    summary "python: pip install FAILED (see python.log)"
    status=1
  fi
fi

# ---- families (issue 18): transformers save_pretrained checkpoints of every family, exports at
# tp 1, 2, 4, 8 against vLLM-style hand slicing, FP8 block audits, audit on cuda:0 at tp 2 ----
if wants families; then
  start=$SECONDS
  {
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    WS_CLI="$build/weightstream" python3 -m pytest -q -p no:cacheprovider -rs "$root/tests/python/test_families.py"
  } >"$out/families.log" 2>&1 || status=1
  dir=$(mktemp -d)
  for arch in llama deepseek_v3 glm4_moe qwen3_moe mixtral kimi_k2; do
    for quantize in none fp8-block; do
      "$build/weightstream" synth "$dir/$arch-$quantize" --arch "$arch" --hidden 512 --vocab 1000 --quantize "$quantize" \
        >>"$out/families.log" 2>&1 &&
        "$build/weightstream" audit "$dir/$arch-$quantize" --device cuda:0 --tp-size 2 --order reversed --batches 9 \
          >>"$out/families.log" 2>&1 || { echo "audit $arch $quantize FAILED" >>"$out/families.log"; status=1; }
    done
  done
  rm -rf "$dir"
  summary "families ($((SECONDS - start)) s): pytest: $(grep -E '[0-9]+ (passed|failed|skipped)' "$out/families.log" | tail -1); audits failed: $(grep -c 'FAILED$' "$out/families.log")"
fi

# ---- audits (issue 16's no-regression list): cold load, shuffled reload in 8 batches and a
# comparison of every parameter on cuda:0, for four families at tp 1, 2 and 8 (one rank each) ----
if wants audits; then
  start=$SECONDS
  dir=$(mktemp -d)
  : >"$out/audits.log"
  failed=0 ran=0
  for arch in llama qwen3 deepseek_v3 qwen3_next; do
    "$build/weightstream" synth "$dir/$arch" --arch "$arch" --hidden 512 --vocab 1024 >>"$out/audits.log" 2>&1 ||
      { echo "synth $arch FAILED" >>"$out/audits.log"; failed=$((failed + 1)); continue; }
    for tp in 1 2 8; do
      rank=$((tp - 1))
      ran=$((ran + 1))
      echo "== $arch tp $tp rank $rank" >>"$out/audits.log"
      "$build/weightstream" audit "$dir/$arch" --device cuda:0 --tp-size $tp --tp-rank $rank --batches 8 --order shuffled \
        --no-progress >>"$out/audits.log" 2>&1 || { echo "audit $arch tp $tp FAILED" >>"$out/audits.log"; failed=$((failed + 1)); }
    done
  done
  rm -rf "$dir"
  [ $failed -eq 0 ] || status=1
  summary "audits ($((SECONDS - start)) s): $ran run on cuda:0, $failed failed"
fi

# ---- gdn: Qwen3-Next's Gated DeltaNet layers across ranks: transformers save_pretrained
# checkpoint exported at tp 1, 2, 4 against hand slicing and vLLM's weight loaders (where vLLM
# is installed), audited on cuda:0 at tp 2 and 4, every rank --------------------------------
if wants gdn; then
  start=$SECONDS
  WS_CLI="$build/weightstream" python3 -m pytest -q -p no:cacheprovider -rs "$root/tests/python/test_qwen3_next_tp.py" \
    >"$out/gdn.log" 2>&1 || status=1
  summary "gdn ($((SECONDS - start)) s): pytest: $(grep -E '[0-9]+ (passed|failed|skipped)' "$out/gdn.log" | tail -1)"
fi

# ---- moe (issue 34): an FP8 block-scaled MoE into torch parameters named as vLLM 0.33 names
# them on the GPU, bound at tp 2 and tp 2 with EP, and a BF16 update quantized into them in
# place over CUDA IPC (bench/gpu_moe_bench.py; WS_GPU_MOE_SIZE, default 8GiB) ---------------
if wants moe; then
  start=$SECONDS
  PYTHONUNBUFFERED=1 PYTHONPATH="$build/python-site" python3 "$root/bench/gpu_moe_bench.py" --cli "$build/weightstream" \
    --out "$out" --size "${WS_GPU_MOE_SIZE:-8GiB}" ${WS_GPU_MOE_ROWS:+--rows "$WS_GPU_MOE_ROWS"} 2>&1 |
    tee "$out/moe.log" || status=1
  summary "moe ($((SECONDS - start)) s): $(grep -c ': yes$' "$out/gpu_moe.md" 2>/dev/null) checks passed," \
    "$(grep -c ': NO$' "$out/gpu_moe.md" 2>/dev/null) failed; $(grep '^Goal' "$out/gpu_moe.md" 2>/dev/null)"
fi

# ---- ucx (issue 34): a peer pull into CUDA parameters and an update over UCX into them, two
# processes on one GPU, against ucx_perftest -m cuda (bench/gpu_ucx_bench.py) ----------------
if wants ucx; then
  start=$SECONDS
  PYTHONUNBUFFERED=1 python3 "$root/bench/gpu_ucx_bench.py" --cli "$build/weightstream" --out "$out" \
    --size "${WS_GPU_UCX_SIZE:-4GiB}" 2>&1 | tee "$out/ucx.log" || status=1
  summary "ucx ($((SECONDS - start)) s): $(grep -c ': yes$' "$out/gpu_ucx.md" 2>/dev/null) checks passed," \
    "$(grep -c ': NO$' "$out/gpu_ucx.md" 2>/dev/null) failed (gpu_ucx.md)"
fi

# ---- pythonpath (issue 44): where the Python front ends' time goes against `load --raw`, on a
# synth llama of WS_GPU_PYTHONPATH_SIZE (default 16GiB, 4 shards), each contender in a fresh
# process, interleaved (bench/python_path_probe.py) ------------------------------------------
if wants pythonpath; then
  start=$SECONDS
  checkpoint=${WS_GPU_PYTHONPATH_DIR:-/tmp/ws-python-path}
  [ -f "$checkpoint/config.json" ] || "$build/weightstream" synth "$checkpoint" --arch llama \
    --size "${WS_GPU_PYTHONPATH_SIZE:-16GiB}" --shards 4 >/dev/null
  cat "$checkpoint"/*.safetensors >/dev/null  # warm
  PYTHONUNBUFFERED=1 python3 "$root/bench/python_path_probe.py" "$checkpoint" --cli "$build/weightstream" \
    --python-site "$build/python-site" --rounds "${WS_GPU_PYTHONPATH_ROUNDS:-3}" --out "$out/python_path_probe.json" \
    2>&1 | tee "$out/python_path.md" || status=1
  summary "pythonpath ($((SECONDS - start)) s): python_path.md"
fi

# ---- ranks (issue 44): `load --raw` against a tp-2 and a tp-8 rank of the pythonpath stage's
# checkpoint, CLI, warm, 3 runs each interleaved: each rank's time against its share of raw ---
# Appends to ranks.txt one line per run of `load CHECKPOINT FLAGS --device cuda:0`, 3 runs of
# each flag set, interleaved.  Usage: time_ranks LABEL CHECKPOINT FLAGS...
time_ranks() {
  local label=$1 checkpoint=$2 run flags
  shift 2
  cat "$checkpoint"/*.safetensors >/dev/null  # warm
  for run in 1 2 3; do
    for flags in "$@"; do
      # shellcheck disable=SC2086  # flags is a list
      "$build/weightstream" load "$checkpoint" $flags --device cuda:0 --no-progress --json 2>&1 |
        python3 -c "import json,sys; r=json.load(sys.stdin); print('$label: $flags run $run', round(r['seconds'],4), 's', round(r['bytes']/1e9,3), 'GB', round(r['bytes']/r['seconds']/1e9,2), 'GB/s')" \
        >>"$out/ranks.txt" 2>&1 || echo "$label: $flags run $run FAILED" >>"$out/ranks.txt"
    done
  done
}
if wants ranks; then
  checkpoint=${WS_GPU_PYTHONPATH_DIR:-/tmp/ws-python-path}
  [ -f "$checkpoint/config.json" ] || "$build/weightstream" synth "$checkpoint" --arch llama \
    --size "${WS_GPU_PYTHONPATH_SIZE:-16GiB}" --shards 4 >/dev/null
  time_ranks ranks "$checkpoint" "--raw" "--tp-size 1 --tp-rank 0" "--tp-size 2 --tp-rank 1" "--tp-size 8 --tp-rank 3"
  # The FP8 block-scaled MoE of the moe stage (its checkpoint A, kept for it): raw against the
  # ranks the CLI builds from config.json at tp 2 and tp 2 + EP 2.
  moe=${WS_GPU_MOE_DIR:-/tmp/ws-moe}/fp8
  [ -f "$moe/config.json" ] || "$build/weightstream" synth "$moe" --arch qwen3_moe --quantize fp8-block \
    --size "${WS_GPU_MOE_SIZE:-8GiB}" --hidden 2048 --experts 16 --shards 8 --seed 1 >/dev/null
  time_ranks "moe ranks" "$moe" "--raw" "--tp-size 2 --tp-rank 0" "--tp-size 2 --tp-rank 1" \
    "--tp-size 2 --tp-rank 0 --ep-size 2 --ep-rank 0"
  cat "$out/ranks.txt"
  summary "ranks: ranks.txt"
fi

# ---- pushed updates (issue 8, transfer layer): CUDA IPC tests and benchmark ------------------
if wants update; then
  OUT=$out "$root/bench/update_bench_gpu.sh" || status=1
fi
# ---- end of the pushed-updates block -------------------------------------------------------

echo "== summary"
cat "$out/summary.txt"
exit $status
