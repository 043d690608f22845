"""scripts/check-sizes.py: no function over 100 lines and no file over 800 lines in src/ and
python/ (issue 48); each offender is named with its file, line and length."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("lizard", reason="check-sizes.py needs lizard (scripts/install-deps.sh installs it)")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "check-sizes.py")

def check(root):
    return subprocess.run([sys.executable, SCRIPT, str(root)], capture_output=True, text=True)


def tree(tmp_path, files):
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


def cpp_function(name, body_lines):
    """A C++ function of `body_lines` statements: body_lines + 2 lines long."""
    return f"int {name}() {{\n" + "  int x = 0;\n" * body_lines + "}\n"


def python_function(name, body_lines):
    return f"def {name}():\n" + "    x = 0\n" * body_lines


def test_this_repository_has_no_function_over_100_lines_and_no_file_over_800():
    result = check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 offender(s)" in result.stdout


def test_a_clean_tree_passes(tmp_path):
    root = tree(tmp_path, {
        "src/base/short.cpp": cpp_function("short_enough", 98),  # 100 lines: the most allowed
        "src/device/kernels.cu": cpp_function("kernel", 10),
        "python/weightstream/_api.py": python_function("load", 99),
        "src/base/long_but_fine.hpp": "// a line\n" * 800,
    })
    result = check(root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 offender(s)" in result.stdout


def test_a_long_function_and_a_long_file_are_named_with_their_lines(tmp_path):
    root = tree(tmp_path, {
        "src/stream/a.cpp": "// the streamer\n\n" + cpp_function("too_long", 99),  # 101 lines, from line 3
        "src/device/b.cu": cpp_function("kernel_launch", 120),
        "python/weightstream/_model.py": "import os\n" + python_function("bind", 150),
        "src/model/big.hpp": "// a line\n" * 801,
        "tests/base/test_long.cpp": cpp_function("not_checked", 200),
        "src/base/__pycache__/x.py": python_function("not_checked", 200),
    })
    result = check(root)
    assert result.returncode == 1
    out = result.stdout
    assert "src/stream/a.cpp:3: too_long is 101 lines (at most 100)" in out
    assert "src/device/b.cu:1: kernel_launch is 122 lines (at most 100)" in out
    assert "python/weightstream/_model.py:2: bind is 151 lines (at most 100)" in out
    assert "src/model/big.hpp: the file is 801 lines (at most 800)" in out
    assert "not_checked" not in out
    assert "4 offender(s)" in out


def test_without_lizard_it_says_what_to_install(tmp_path):
    # A Python that cannot import lizard: an empty module of that name that raises on import.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "lizard.py").write_text("raise ImportError('no lizard here')\n")
    env = dict(os.environ, PYTHONPATH=str(shadow))
    result = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env)
    assert result.returncode == 2
    assert "lizard is not installed" in result.stderr
