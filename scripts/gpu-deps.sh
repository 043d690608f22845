#!/usr/bin/env bash
# Copies the C++ dependencies that the GPU machine lacks (it has nvcc, CMake and ninja but
# no -dev packages and no package registry) from this machine's system into .deps/, an
# ignored folder that travels with the working tree (the device tool's `carry`), where
# scripts/gpu.sh builds with -DWS_DEPS_DIR=.deps.
#   .deps/include      headers
#   .deps/lib          static libraries; libcurl, OpenSSL and pugixml as shared libraries
#                      with the libraries they load (except glibc's), for linking and running
#   .deps/lib/cmake, .deps/share/cmake   the CMake package configs
#   .deps/ucx-cu13.tar.xz  a CUDA-aware UCX (headers, shared libraries, its transport modules,
#                      ucx_perftest and ucx_info) from the PyPI wheel libucx-cu13, for the
#                      driver's CUDA 13; scripts/gpu.sh unpacks it and builds against it
# Usage: scripts/gpu-deps.sh   (needs the Debian -dev packages of the build and pip; ~30 MiB)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps="$root/.deps"
multiarch=$(gcc -print-multiarch)
syslib=/usr/lib/$multiarch
rm -rf "$deps/include" "$deps/lib" "$deps/share"
mkdir -p "$deps/include" "$deps/lib/cmake" "$deps/share/cmake"

# Headers.
for dir in nlohmann CLI gtest gmock openssl liburing; do cp -rL "/usr/include/$dir" "$deps/include/"; done
cp -L /usr/include/{xxhash.h,xxh3.h,liburing.h,pugixml.hpp,pugiconfig.hpp} "$deps/include/"
# Debian keeps these architecture-specific headers apart.
cp -rL "/usr/include/$multiarch/curl" "$deps/include/"
cp -L "/usr/include/$multiarch/openssl/"*.h "$deps/include/openssl/"

# Static libraries: nothing to carry at run time.
cp -L "$syslib"/lib{gtest,gtest_main,gmock,gmock_main,uring,xxhash,pugixml}.a "$deps/lib/"
# pugixml's CMake config checks that its shared library exists too.
pugixml_so=$(basename "$(readlink -f "$syslib/libpugixml.so")")
cp -L "$syslib/$pugixml_so" "$deps/lib/"
ln -sf "$pugixml_so" "$deps/lib/libpugixml.so.1"

# libcurl and OpenSSL as shared libraries (Debian ships no usable static libcurl), with
# every library they load except glibc's. Linking needs the unversioned names; loading
# needs the sonames.
copy_closure() {
  local library=$1
  cp -L "$library" "$deps/lib/$(basename "$library")"
  ldd "$library" | awk '/=>/ {print $1, $3}' | while read -r soname path; do
    case "$soname" in libc.so.*|libm.so.*|libresolv.so.*|libpthread.so.*|libdl.so.*|ld-linux*) continue ;; esac
    [[ -e "$deps/lib/$soname" ]] || cp -L "$path" "$deps/lib/$soname"
  done
}
copy_closure "$syslib/libcurl.so.4"
copy_closure "$syslib/libcrypto.so.3"
copy_closure "$syslib/libssl.so.3"
ln -sf libcurl.so.4 "$deps/lib/libcurl.so"
ln -sf libcrypto.so.3 "$deps/lib/libcrypto.so"
ln -sf libssl.so.3 "$deps/lib/libssl.so"

# CMake package configs. nlohmann_json's and CLI11's compute their prefix from their own
# location and move as they are. GTest's and pugixml's sat one folder deeper
# (lib/<multiarch>/cmake/<name>) and name that folder: climb one level less, drop the name.
cp -rL /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$deps/share/cmake/"
for package in GTest pugixml; do
  cp -rL "$syslib/cmake/$package" "$deps/lib/cmake/"
  for config in "$deps/lib/cmake/$package/"*.cmake; do
    sed -i "s|/$multiarch/|/|g; s|lib/$multiarch|lib|g" "$config"
    awk '/get_filename_component\(_IMPORT_PREFIX "\$\{_IMPORT_PREFIX\}" PATH\)/ && !dropped {dropped = 1; next} {print}' \
      "$config" >"$config.new"
    mv "$config.new" "$config"
  done
done
# A CUDA-aware UCX: the wheel's files without its static libraries, each shared library once
# (the wheel, a zip, holds three copies: .so, .so.0, .so.0.0.0; the first two become links).
ucx_version=${WS_UCX_WHEEL_VERSION:-1.22.0}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$scratch" "libucx-cu13==$ucx_version"
(cd "$scratch" && unzip -q ./*.whl &&
  for library in $(find libucx/lib -name '*.so.0.0.0'); do
    ln -sf "$(basename "$library")" "${library%.0.0}" && ln -sf "$(basename "$library")" "${library%.0.0.0}"
  done &&
  tar -cJf "$deps/ucx-cu13.tar.xz" libucx/include libucx/lib/*.so* libucx/lib/ucx/*.so* libucx/bin/ucx_perftest \
    libucx/bin/ucx_info libucx_cu13.libs)
du -sh "$deps"
