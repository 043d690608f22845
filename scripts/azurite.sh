# Sourced by scripts/test.sh: starts an Azure Blob emulator for the az:// tests where one is
# installed, and exports WS_TEST_AZURE_CONNECTION_STRING (a connection string with its
# BlobEndpoint) for them. No Blob emulator installs from PyPI or Debian (docs/AZURE.md says
# which were tried): Azurite comes from npm, so this starts `azurite-blob` only where it is on
# the PATH; elsewhere the az:// tests that need an emulator skip, saying so. A run may also name
# an emulator it started itself by setting WS_TEST_AZURE_CONNECTION_STRING before test.sh.
# Usage: . scripts/azurite.sh LOGFILE
azurite_pid=""
stop_azurite() { if [ -n "$azurite_pid" ]; then kill "$azurite_pid" 2>/dev/null || true; wait "$azurite_pid" 2>/dev/null || true; fi; }
ws_on_exit="${ws_on_exit:-} stop_azurite;"
trap 'eval "$ws_on_exit"' EXIT
if [ -n "${WS_TEST_AZURE_CONNECTION_STRING:-}" ]; then
  echo "Azure Blob emulator given by WS_TEST_AZURE_CONNECTION_STRING"
elif command -v azurite-blob >/dev/null 2>&1; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # --skipApiVersionCheck: Azurite refuses service versions newer than its own by default.
  azurite-blob --blobHost 127.0.0.1 --blobPort "$port" --inMemoryPersistence --skipApiVersionCheck \
    --location "$(mktemp -d)" >"$1" 2>&1 &
  azurite_pid=$!
  for _ in $(seq 1 100); do
    if python3 -c "import socket; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null; then break; fi
    sleep 0.1
  done
  # The emulator's well-known account and key (public; Microsoft's docs give them).
  export WS_TEST_AZURE_CONNECTION_STRING="DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==;BlobEndpoint=http://127.0.0.1:$port/devstoreaccount1;"
  echo "azurite-blob on http://127.0.0.1:$port"
else
  echo "no Azure Blob emulator (azurite-blob is not installed; none installs from PyPI or Debian): az:// tests that need one will be skipped"
fi
