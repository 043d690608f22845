#!/usr/bin/env bash
# The SGLang stage: --load-format weightstream and pushed updates of weightstream.sglang,
# tested against the real SGLang 0.5.23 on the CPU (tests/python/test_sglang_models.py:
# SGLang's own model classes built by its ModelRunner, loaded by its DefaultModelLoader as
# the oracle and by weightstream; updates through its update_weights_from_tensor). Only
# sgl_kernel, SGLang's CUDA kernel package, is a stub (tests/python/sglang_stubs: it fails to
# import without libcuda, and no kernel of it runs on the CPU path). Not part of
# scripts/test.sh or CI: the install is about 11 GB and takes about 14 minutes (docs/SGLANG.md
# has the times measured). Run it before an issue touching python/weightstream/sglang/ is resolved.
#
# Usage: scripts/sglang-test.sh [pytest arguments]
#   WS_SGLANG_VENV     the virtual environment holding SGLang (default build/venv-sglang; made and
#                      filled with sglang==$WS_SGLANG_VERSION, transformers, boto3 and pytest when it lacks them)
#   WS_SGLANG_VERSION  the SGLang release to install (default 0.5.23, the one weightstream.sglang
#                      was written against)
#   WS_VLLM_VENV       vLLM's environment, for the pulls between an SGLang and a vLLM instance
#                      (default build/venv-vllm where scripts/vllm-test.sh made it; skipped without)
# The package is built from this checkout with the system python3 into build/python-site
# (as scripts/test.sh does), which the environment's python (the same Python version) imports.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WS_BUILD_DIR:-$root/build}
. "$root/scripts/engine-venv.sh" sglang "${WS_SGLANG_VERSION:-0.5.23}" "${WS_SGLANG_VENV:-$build/venv-sglang}" "about 11 GB, about 14 minutes"

started=$(date +%s)
# moto's S3 server for the s3:// scenario.
. "$root/scripts/moto-server.sh" "$build/moto-sglang.log"
# SGLang's CPU engine; the sgl_kernel stub before the real (CUDA-only) one.
export SGLANG_USE_CPU_ENGINE=1
if [ -z "${WS_VLLM_VENV:-}" ] && [ -x "$build/venv-vllm/bin/python" ]; then
  export WS_VLLM_VENV="$build/venv-vllm"
fi
PYTHONPATH="$root/tests/python/sglang_stubs:$python_site" "$venv/bin/python" -m pytest -q \
  "$root/tests/python/test_sglang.py" "$root/tests/python/test_sglang_models.py" \
  "$root/tests/python/test_sglang_metrics.py" "$root/tests/python/test_sglang_engine.py" \
  "$root/tests/python/test_sglang_vllm_peers.py" "$@"
echo "SGLang stage: $(( $(date +%s) - started )) s of tests"
