#!/usr/bin/env bash
# The first README command: install what is needed, build, then run the main job on a
# built-in sample (a synthetic llama checkpoint written by `weightstream synth`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "${WS_SKIP_DEPS:-0}" != 1 ]; then "$root/scripts/install-deps.sh"; fi
"$root/scripts/build.sh" weightstream_cli
build=${WS_BUILD_DIR:-$root/build}
sample="$build/sample-llama"
rm -rf "$sample"
"$build/weightstream" synth "$sample" --arch llama --layers 4 --hidden 512 --shards 2 --seed 1
"$build/weightstream" inspect "$sample" | tail -n 1
"$build/weightstream" load "$sample" --memory-limit 64MiB
