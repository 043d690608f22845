#!/usr/bin/env bash
# The second README command: build, then run every test (C++ unit tests through ctest and
# the Python tests through pytest) against a real S3-compatible server (moto), a real GCS
# emulator (fake-gcs-server) and, where one is installed, an Azure Blob emulator (Azurite),
# each started on a free loopback port and stopped at the end.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WS_BUILD_DIR:-$root/build}
"$root/scripts/build.sh"

. "$root/scripts/moto-server.sh" "$build/moto.log"
. "$root/scripts/fake-gcs-server.sh" "$build/fake-gcs-server.log"
. "$root/scripts/azurite.sh" "$build/azurite.log"

status=0
# The include rules of docs/ARCHITECTURE.md (its table of layers), checked on every run.
python3 "$root/scripts/check-layers.py" "$root" || status=1
# The sizes of issue 48: no function over 100 lines, no file over 800, in src/ and python/.
python3 "$root/scripts/check-sizes.py" "$root" || status=1
(cd "$build" && ctest --output-on-failure -j "${WS_JOBS:-$(nproc)}" --timeout 600) || status=1
export WS_CLI="$build/weightstream"
# ---- Python package (python/, issue 6) ------------------------------------------------
# Installs the package built from this checkout into a throwaway directory that only the
# pytest run below sees, so tests/python imports the compiled module. scikit-build-core
# keeps its build tree under build/python/ (pyproject.toml), so a rerun recompiles only
# what changed. WS_SKIP_PYTHON_PACKAGE=1 skips it (tests needing it then skip).
if [ "${WS_SKIP_PYTHON_PACKAGE:-0}" != 1 ]; then
  python_site="$build/python-site"
  if CMAKE_BUILD_PARALLEL_LEVEL="${WS_JOBS:-$(nproc)}" python3 -m pip install --no-build-isolation --no-deps \
      --disable-pip-version-check --root-user-action=ignore -q --upgrade --target "$python_site" "$root"; then
    export PYTHONPATH="$python_site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "pip install of the Python package failed" >&2
    status=1
  fi
fi
# ---- end of the Python package block ---------------------------------------------------
if [ -d "$root/tests/python" ]; then
  # pytest exits 5 when it collects nothing; that is not a failure of the suite.
  python3 -m pytest -q "$root/tests/python" || { rc=$?; [ "$rc" = 5 ] || status=1; }
fi
# ---- Installing (issue 47): the wheel and the C++ package --------------------------------
# scripts/test-package.sh builds the repaired wheel (reusing the Python package's build tree
# above), installs it into a fresh virtual environment and runs its command and its module
# with no compiler on the PATH, then builds tests/package against `cmake --install` of this
# build (docs/INSTALL.md). WS_TEST_PACKAGE=0 skips it.
if [ "${WS_TEST_PACKAGE:-1}" != 0 ]; then
  WS_BUILD_DIR="$build" "$root/scripts/test-package.sh" || status=1
fi
# ---- end of the installing checks ------------------------------------------------------
# ---- Reliability stages (issue 7): sanitizers and fuzzing -----------------------------
# Heavy (two more builds of the suite and one with clang), so they run in CI (CI=true) or on
# request (WS_TEST_FULL=1), and WS_TEST_FULL=0 skips them anywhere. They reuse build-asan/,
# build-tsan/ and build-fuzz/ between runs and see the moto and fake-gcs-server started above.
# WS_FUZZ_SECONDS bounds each fuzz target (20 s here); WS_SANITIZE_STAGES picks the
# sanitizer builds ("asan tsan" by default). docs/RELIABILITY.md lists the times measured.
if [ "${WS_TEST_FULL:-}" = 1 ] || { [ "${CI:-}" = true ] && [ "${WS_TEST_FULL:-}" != 0 ]; }; then
  "$root/scripts/sanitize.sh" || status=1
  WS_FUZZ_SECONDS=${WS_FUZZ_SECONDS:-20} "$root/scripts/fuzz.sh" || status=1
fi
# ---- end of the reliability stages -----------------------------------------------------
exit $status
