#!/usr/bin/env bash
# Issue 47's installing checks, run by scripts/test.sh after the build (docs/INSTALL.md):
#  1. the wheel: scripts/build-wheel.sh builds and repairs it; it is installed into a fresh
#     virtual environment and used with a PATH that holds the environment's bin/ and a few
#     shell tools, no compiler: every library its module and its command load is one it
#     carries or one of glibc's and GCC's runtime; `weightstream synth`, `load` and `digest`
#     from the installed command; a Python weightstream.load whose tensors hash to the
#     command's digests; a peer pull between two of its commands over its own UCX; an S3
#     load through its own libcurl and OpenSSL when a moto server runs (WS_TEST_S3_ENDPOINT).
#  2. the C++ package: `cmake --install` of the build into a prefix, then tests/package (an
#     outside project: find_package(weightstream)) built against it and run on the sample.
# Prints each check as it passes; exits 1 at the first that fails, saying what it saw.
#   WS_BUILD_DIR  the configured and built tree to install from (default build/)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WS_BUILD_DIR:-$root/build}
# scripts/test.sh points PYTHONPATH at the package it installed for pytest; the venv below
# must see only the wheel (pip would otherwise find weightstream installed and skip it).
unset PYTHONPATH PYTHONHOME
work=$(mktemp -d)
serve_pid=""
cleanup() {
  if [ -n "$serve_pid" ]; then kill "$serve_pid" 2>/dev/null || true; wait "$serve_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "test-package.sh: FAILED: $*" >&2; exit 1; }
pass() { echo "test-package.sh: ok: $*"; }

# ---- 1. the wheel ----------------------------------------------------------------------
"$root/scripts/build-wheel.sh" "$build/wheelhouse" >"$work/build-wheel.log" 2>&1 ||
  fail "scripts/build-wheel.sh: $(tail -n 30 "$work/build-wheel.log")"
wheel=$(tail -n 1 "$work/build-wheel.log")
[ -f "$wheel" ] || fail "scripts/build-wheel.sh made no wheel (last line: $wheel)"
pass "built $(basename "$wheel") ($(grep "repairing to" "$work/build-wheel.log"))"

venv="$work/venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --no-index --no-deps --disable-pip-version-check "$wheel"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')

# The tools the checks below run, and nothing else: no cc, c++, gcc, g++ or clang.
tools="$work/tools"
mkdir "$tools"
for tool in bash sh cat grep sed head tail ldd; do
  ln -s "$(command -v "$tool")" "$tools/$tool"
done
# bare [NAME=VALUE...] COMMAND ARGS: COMMAND with only these variables set.
bare_environment=(env -i HOME="$work" LANG=C.UTF-8 PATH="$venv/bin:$tools")
bare() { "${bare_environment[@]}" "$@"; }
for compiler in cc c++ gcc g++ clang clang++; do
  if found=$(bare bash -c "command -v $compiler"); then fail "$compiler is on the bare PATH ($found)"; fi
done
pass "no compiler on the PATH of the checks"

# Every library the module and the command load resolves into the wheel's own copies
# (weightstream.libs/) or to glibc and GCC's runtime, which every manylinux system has.
system_runtime='/(libc|libm|libdl|librt|libpthread|libresolv|libz|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so'
for binary in "$site"/weightstream/_core*.so "$site/weightstream/bin/weightstream"; do
  libraries=$(bare ldd "$binary")
  if grep -q "not found" <<<"$libraries"; then fail "$binary: a library is not found:"$'\n'"$libraries"; fi
  outside=$(grep "=> /" <<<"$libraries" | grep -v "/weightstream.libs/" | grep -Ev "$system_runtime" || true)
  [ -z "$outside" ] || fail "$binary loads libraries from outside the wheel:"$'\n'"$outside"
done
pass "module and command load only the wheel's libraries and the system's C and C++ runtime"

sample="$work/sample-llama"
bare weightstream synth "$sample" --arch llama --layers 2 --hidden 128 --shards 2 --seed 1 >/dev/null
loaded=$(bare weightstream load "$sample")
grep -q "^loaded 21 tensors" <<<"$loaded" || fail "weightstream load printed: $loaded"
pass "weightstream load (installed command): ${loaded%%$'\n'*}"

bare weightstream digest "$sample" --hash sha256 >"$work/digests"
bare python - "$sample" "$work/digests" <<'EOF' || fail "the Python load from the wheel disagrees with the command's digests"
import hashlib, sys
import weightstream
sample, digests = sys.argv[1:]
# One "HEX  NAME" line per tensor, then the content digest's line.
expected = dict(reversed(line.split()) for line in open(digests) if not line.startswith("content digest"))
tensors = weightstream.load(sample)
got = {name: hashlib.sha256(memoryview(tensor).cast("B")).hexdigest() for name, tensor in tensors.items()}
if got != expected or len(got) != 21:
    sys.exit(f"loaded {len(got)} tensors; differing: {sorted(n for n in got if got[n] != expected.get(n))}")
print(f"test-package.sh: ok: Python weightstream.load (installed module): {len(got)} tensors, each equal to "
      f"the command's sha256 digest")
EOF

# A peer pull between two installed commands: UCX as the wheel carries it, its modules
# included (python/CMakeLists.txt), with the token on standard input.
serve_log="$work/serve.log"
echo token >"$work/token"
# Not through the function, whose subshell would be $!: env, the console script and the
# command exec one another, so $! is the server's own pid.
"${bare_environment[@]}" weightstream serve "$sample" --token-stdin <"$work/token" >"$serve_log" 2>&1 &
serve_pid=$!
address=""
for _ in $(seq 1 600); do
  address=$(grep -o "peer://[0-9.:]*" "$serve_log" || true)
  if [ -n "$address" ] || ! kill -0 "$serve_pid" 2>/dev/null; then break; fi
  sleep 0.1
done
[ -n "$address" ] || fail "weightstream serve did not start: $(cat "$serve_log")"
pulled=$(bare weightstream load "$address" --token-stdin <"$work/token" 2>&1) || fail "pull from $address: $pulled"
grep -q "^loaded 15 parameters .* from peers" <<<"$pulled" || fail "pull from $address printed: $pulled"
kill "$serve_pid"; wait "$serve_pid" 2>/dev/null || true; serve_pid=""
pass "peer pull between installed commands: ${pulled%%$'\n'*}"

if [ -n "${WS_TEST_S3_ENDPOINT:-}" ] && python3 -c "import boto3" 2>/dev/null; then
  bucket="wheel-$$-$RANDOM"
  python3 - "$WS_TEST_S3_ENDPOINT" "$bucket" "$sample" <<'EOF'
import os, sys
import boto3
endpoint, bucket, sample = sys.argv[1:]
client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")
client.create_bucket(Bucket=bucket)
for name in sorted(os.listdir(sample)):
    client.upload_file(os.path.join(sample, name), bucket, "llama/" + name)
EOF
  s3=$(bare AWS_ENDPOINT_URL="$WS_TEST_S3_ENDPOINT" AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing \
       AWS_REGION=us-east-1 weightstream digest "s3://$bucket/llama" --hash sha256) || fail "S3 digest: $s3"
  [ "$s3" = "$(cat "$work/digests")" ] || fail "digests of s3://$bucket/llama differ from the local ones"
  pass "weightstream digest s3://$bucket/llama (the wheel's libcurl and OpenSSL) equals the local digests"
else
  echo "test-package.sh: S3 check skipped: no moto server (WS_TEST_S3_ENDPOINT) or no boto3"
fi

# ---- 2. the C++ package ----------------------------------------------------------------
prefix="$work/prefix"
cmake --install "$build" --prefix "$prefix" --component library >/dev/null
cmake --install "$build" --prefix "$prefix" --component command >/dev/null
[ -f "$prefix/lib/cmake/weightstream/weightstreamConfig.cmake" ] || fail "no weightstreamConfig.cmake under $prefix"
consumer="$build/package-consumer"
rm -rf "$consumer"
cmake -S "$root/tests/package" -B "$consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >"$work/consumer.log" 2>&1 ||
  fail "configuring tests/package against $prefix: $(cat "$work/consumer.log")"
cmake --build "$consumer" >>"$work/consumer.log" 2>&1 || fail "building tests/package: $(cat "$work/consumer.log")"
checked=$("$consumer/load_checkpoint" "$sample") || fail "tests/package's load_checkpoint: $checked"
grep -q "^loaded 21 tensors, .*: every byte matches$" <<<"$checked" || fail "load_checkpoint printed: $checked"
pass "find_package(weightstream) from the installed package: $checked"
installed=$("$prefix/bin/weightstream" load "$sample" | head -n 1)
pass "installed command $prefix/bin/weightstream: $installed"
