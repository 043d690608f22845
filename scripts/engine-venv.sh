# Sourced by the engine stages (scripts/vllm-test.sh, scripts/sglang-test.sh):
#   . scripts/engine-venv.sh PACKAGE VERSION VENV "SIZE TEXT"
# Makes VENV and installs PACKAGE==VERSION with pytest, transformers and boto3 where it lacks
# them, checks that its Python is the system python3's version, and builds this checkout's
# package with the system python3 into $build/python-site (as scripts/test.sh does), which
# the environment's python imports. Needs $root and $build; sets $venv and $python_site.
engine_package=$1
engine_version=$2
venv=$3
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$engine_package') != '$engine_version')" 2>/dev/null; then
  echo "installing $engine_package==$engine_version into $venv ($4)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --disable-pip-version-check -q "$engine_package==$engine_version"
fi
"$venv/bin/python" -c "import pytest, transformers, boto3" 2>/dev/null ||
  "$venv/bin/pip" install --disable-pip-version-check -q pytest transformers boto3

system_python=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv_python=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$system_python" != "$venv_python" ]; then
  echo "python3 is $system_python but $venv has Python $venv_python: the package built here would not import there" >&2
  exit 1
fi
python_site="$build/python-site"
CMAKE_BUILD_PARALLEL_LEVEL="${WS_JOBS:-$(nproc)}" python3 -m pip install --no-build-isolation --no-deps \
  --disable-pip-version-check --root-user-action=ignore -q --upgrade --target "$python_site" "$root"
