#!/usr/bin/env bash
# The vLLM stage: the vLLM loader, weight-transfer backend and MTP draft load of
# weightstream.vllm, tested against the real vLLM 0.33.0 on the CPU (tests/python/test_vllm.py,
# and tests/python/test_vllm_models.py: vLLM's own model classes of every family, BF16 and FP8,
# tp 1, 2 and 2 with expert parallelism, loads and pushed updates; nothing of vLLM is mocked). Not part of scripts/test.sh or CI: the install is about 9.5 GB
# and takes longer than CI allows (docs/VLLM.md has the times measured). Run it before an
# issue touching python/weightstream/vllm/ is resolved.
#
# Usage: scripts/vllm-test.sh [pytest arguments]
#   WS_VLLM_VENV     the virtual environment holding vLLM (default build/venv-vllm; made and
#                    filled with vllm==$WS_VLLM_VERSION and pytest when it lacks them)
#   WS_VLLM_VERSION  the vLLM release to install (default 0.33.0; 0.34.0 pins a flashinfer
#                    release some registries lack)
# The package is built from this checkout with the system python3 into build/python-site
# (as scripts/test.sh does), which the environment's python (the same Python version) imports.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WS_BUILD_DIR:-$root/build}
. "$root/scripts/engine-venv.sh" vllm "${WS_VLLM_VERSION:-0.33.0}" "${WS_VLLM_VENV:-$build/venv-vllm}" "about 9.5 GB"

export WS_CLI="$build/weightstream"
export VLLM_TARGET_DEVICE=cpu
# moto's S3 server for the s3:// scenario.
. "$root/scripts/moto-server.sh" "$build/moto-vllm.log"
PYTHONPATH="$python_site" "$venv/bin/python" -m pytest -q "$root/tests/python/test_vllm.py" \
  "$root/tests/python/test_vllm_models.py" "$root/tests/python/test_vllm_metrics.py" "$@"
