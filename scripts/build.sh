#!/usr/bin/env bash
# Configures (once) and builds weightstream into build/ (or $WS_BUILD_DIR): every target,
# or only the targets named as arguments (e.g. weightstream_cli).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WS_BUILD_DIR:-$root/build}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${WS_BUILD_TYPE:-RelWithDebInfo} ${WS_CMAKE_ARGS:-}
fi
targets=()
for target in "$@"; do targets+=(--target "$target"); done
cmake --build "$build" -j "${WS_JOBS:-$(nproc)}" "${targets[@]}"
