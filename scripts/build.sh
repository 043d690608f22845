#!/usr/bin/env bash
# Configures (once) and builds weightstream into build/ (or $WS_BUILD_DIR).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WS_BUILD_DIR:-$root/build}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${WS_BUILD_TYPE:-RelWithDebInfo} ${WS_CMAKE_ARGS:-}
fi
cmake --build "$build" -j "${WS_JOBS:-$(nproc)}"
