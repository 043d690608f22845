#!/usr/bin/env bash
# The second README command: build, then run every test (C++ unit tests through ctest and
# the Python tests through pytest) against a real S3-compatible server (moto) started on a
# free loopback port and stopped at the end.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WS_BUILD_DIR:-$root/build}
"$root/scripts/build.sh"

moto_pid=""
stop_moto() { if [ -n "$moto_pid" ]; then kill "$moto_pid" 2>/dev/null || true; wait "$moto_pid" 2>/dev/null || true; fi; }
trap stop_moto EXIT
if command -v moto_server >/dev/null 2>&1; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  moto_server -H 127.0.0.1 -p "$port" >"$build/moto.log" 2>&1 &
  moto_pid=$!
  for _ in $(seq 1 100); do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null; then break; fi
    sleep 0.1
  done
  export WS_TEST_S3_ENDPOINT="http://127.0.0.1:$port"
  export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1
  unset AWS_SESSION_TOKEN AWS_PROFILE AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3 || true
  echo "moto S3 server on $WS_TEST_S3_ENDPOINT"
else
  echo "moto_server not found: S3 tests will be skipped (scripts/install-deps.sh installs it)"
fi

status=0
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
# ---- Reliability stages (issue 7): sanitizers and fuzzing -----------------------------
# Heavy (two more builds of the suite and one with clang), so they run in CI (CI=true) or on
# request (WS_TEST_FULL=1), and WS_TEST_FULL=0 skips them anywhere. They reuse build-asan/,
# build-tsan/ and build-fuzz/ between runs and see the moto server started above.
# WS_FUZZ_SECONDS bounds each fuzz target (20 s here); WS_SANITIZE_STAGES picks the
# sanitizer builds ("asan tsan" by default). docs/RELIABILITY.md lists the times measured.
if [ "${WS_TEST_FULL:-}" = 1 ] || { [ "${CI:-}" = true ] && [ "${WS_TEST_FULL:-}" != 0 ]; }; then
  "$root/scripts/sanitize.sh" || status=1
  WS_FUZZ_SECONDS=${WS_FUZZ_SECONDS:-20} "$root/scripts/fuzz.sh" || status=1
fi
# ---- end of the reliability stages -----------------------------------------------------
exit $status
