#!/usr/bin/env bash
# Runs the test suite under sanitizers (issue 7):
#   - the whole ctest suite built with AddressSanitizer + UndefinedBehaviorSanitizer in
#     build-asan/ (S3 tests run when WS_TEST_S3_ENDPOINT is set, as scripts/test.sh does);
#   - the stream and staging-pool tests (test_stream) built with ThreadSanitizer in build-tsan/.
# Each build directory is configured once and reused, so a rerun rebuilds only what changed.
# CUDA is left out of these builds: the CUDA runtime maps memory where ASan keeps its
# shadow, and there is no device to test against on the CI machine anyway.
#
# Environment: WS_JOBS (build jobs, default 2), WS_SANITIZE_STAGES ("asan tsan" by default;
# name one to run only it), WS_ASAN_BUILD_DIR / WS_TSAN_BUILD_DIR (build directories).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${WS_JOBS:-2}
stages=${WS_SANITIZE_STAGES:-asan tsan}
asan_build=${WS_ASAN_BUILD_DIR:-$root/build-asan}
tsan_build=${WS_TSAN_BUILD_DIR:-$root/build-tsan}

# Any report fails the run (halt_on_error), with symbolized stacks; leaks are reported at
# exit of every test process. abort_on_error is left off so gtest's output is kept.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/tsan-suppressions.txt}

# -O1 with line tables only: what the sanitizers' documentation recommends for readable
# stacks, and about half the compile time of -O2 -g on the 2-core CI machine.
configure() {  # configure BUILD_DIR SANITIZERS [CMAKE ARGS...]
  local dir=$1 sanitizers=$2
  shift 2
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
      -DWS_SANITIZE="$sanitizers" -DWS_WITH_CUDA=OFF -DWS_BUILD_TESTS=ON "$@"
  fi
}

status=0
for stage in $stages; do
  case $stage in
    asan)
      configure "$asan_build" address,undefined
      start=$SECONDS
      cmake --build "$asan_build" -j "$jobs"
      echo "sanitize: asan build took $((SECONDS - start)) s"
      start=$SECONDS
      (cd "$asan_build" && ctest --output-on-failure -j "$jobs" --timeout 900) || status=1
      echo "sanitize: asan+ubsan ctest took $((SECONDS - start)) s"
      ;;
    tsan)
      # Without UCX: its memory hooks (ucm) patch mmap and malloc under ThreadSanitizer's
      # interceptors and the process dies at its first allocation; test_stream needs no UCX.
      configure "$tsan_build" thread -DWS_WITH_UCX=OFF
      start=$SECONDS
      cmake --build "$tsan_build" -j "$jobs" --target test_stream
      echo "sanitize: tsan build took $((SECONDS - start)) s"
      start=$SECONDS
      # The streamer's reader pool and the staging pool are where threads meet; the CUDA
      # tests skip without a device and are left out.
      "$tsan_build/tests/test_stream" --gtest_filter='*StreamExactlyOnce*:Streamer.*:Digest.*:Load.*:Checkpoint.*:Stream.*Prefetchers*' \
        || status=1
      echo "sanitize: tsan test_stream took $((SECONDS - start)) s"
      ;;
    *) echo "sanitize: unknown stage '$stage' (asan | tsan)" >&2; exit 2 ;;
  esac
done
exit $status
