# Sourced by scripts/test.sh and scripts/vllm-test.sh: starts moto's S3 server on a free
# loopback port (when moto_server is installed; scripts/install-deps.sh installs it), exports
# WS_TEST_S3_ENDPOINT and test credentials, and stops the server when the script exits.
# Usage: . scripts/moto-server.sh LOGFILE
moto_pid=""
stop_moto() { if [ -n "$moto_pid" ]; then kill "$moto_pid" 2>/dev/null || true; wait "$moto_pid" 2>/dev/null || true; fi; }
# Services sourced one after another (scripts/fake-gcs-server.sh too) each add their stop to one trap.
ws_on_exit="${ws_on_exit:-} stop_moto;"
trap 'eval "$ws_on_exit"' EXIT
if command -v moto_server >/dev/null 2>&1; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  moto_server -H 127.0.0.1 -p "$port" >"$1" 2>&1 &
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
