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
if [ -d "$root/tests/python" ]; then
  python3 -m pytest -q "$root/tests/python" || status=1
fi
exit $status
