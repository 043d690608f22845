#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/fuzz_*.cpp) with clang in build-fuzz/ and runs each
# for a bounded time from its seed corpus (fuzz/corpus/<target>/). A crash, a sanitizer
# report, a leak or a timeout fails the run; the input that caused it is left in
# build-fuzz/artifacts/ and should become a regression test (a file under tests/ that the
# parser must reject with a clean Error).
#
# Environment:
#   WS_FUZZ_SECONDS  seconds per target (default 30)
#   WS_FUZZ_TARGETS  targets to run (default: every fuzz/fuzz_*.cpp)
#   WS_JOBS          build jobs (default 2)
#   WS_FUZZ_BUILD_DIR  build directory (default build-fuzz)
# New inputs found are kept in build-fuzz/corpus/<target>/ between runs, never in the
# repository: the committed seeds stay small and reviewed (fuzz/make_corpus.py).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WS_FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=${WS_FUZZ_SECONDS:-30}
jobs=${WS_JOBS:-2}

# CUDA stays out: the fuzz targets parse bytes and never touch a device.
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DWS_BUILD_FUZZ=ON -DWS_BUILD_TESTS=OFF -DWS_WITH_CUDA=OFF >/dev/null
# Every target fuzz/CMakeLists.txt defined (one per fuzz/fuzz_*.cpp whose parser exists).
targets=${WS_FUZZ_TARGETS:-$(ninja -C "$build" -t targets all | sed -n 's/^\(fuzz_[a-z0-9_]*\): phony$/\1/p' | tr '\n' ' ')}
start=$SECONDS
# shellcheck disable=SC2086  # targets is a list
cmake --build "$build" -j "$jobs" --target $targets
echo "fuzz: build took $((SECONDS - start)) s"

mkdir -p "$build/artifacts"
status=0
summary=""
for target in $targets; do
  corpus="$build/corpus/$target"
  mkdir -p "$corpus"
  log="$build/$target.log"
  start=$SECONDS
  # -timeout: one input taking over 10 s is a hang; -rss_limit_mb: a parser that sizes an
  # allocation from its input fails here rather than on a user's machine.
  if "$build/fuzz/$target" "$corpus" "$root/fuzz/corpus/$target" -max_total_time="$seconds" -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$build/artifacts/$target-" >"$log" 2>&1; then
    result=ok
  else
    result=FAILED
    status=1
    echo "fuzz: $target FAILED; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
  fi
  elapsed=$((SECONDS - start))
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  units=$(find "$corpus" -type f | wc -l)
  line=$(printf '%-26s %-6s %5s s %12s runs %9s runs/s %6s corpus' "$target" "$result" "$elapsed" "${runs:-?}" \
    "${rate:-?}" "$units")
  echo "fuzz: $line"
  summary+="$line"$'\n'
done
echo "fuzz: summary (${seconds} s per target)"
printf '%s' "$summary"
exit $status
