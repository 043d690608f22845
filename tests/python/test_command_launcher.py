"""The `weightstream` console script of the wheel (python/weightstream_command.py): it runs
the compiled command the package carries, without importing the package, and says so when
the command is missing. scripts/test.sh installs the package with its command; the
repaired wheel itself is run by scripts/test-package.sh.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

weightstream_command = pytest.importorskip("weightstream_command")


def test_the_command_sits_in_the_installed_package():
    path = Path(weightstream_command.command_path())
    assert path.parent.name == "bin" and path.parent.parent.name == "weightstream"
    assert path.parent.parent.joinpath("__init__.py").exists()
    assert os.access(path, os.X_OK), f"{path} is not an executable command"


def test_main_becomes_the_command_with_its_arguments_and_exit_status():
    code = ("import sys, weightstream_command; weightstream_command.main()")
    version = subprocess.run([sys.executable, "-c", code, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == "weightstream 0.1.0"
    missing = subprocess.run([sys.executable, "-c", code, "load", "/nonexistent/checkpoint"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0
    assert "/nonexistent/checkpoint" in missing.stderr and "does not exist" in missing.stderr


def test_main_does_not_import_the_package():
    # The package imports torch where installed and loads the compiled core; the command
    # needs neither. os.execv is replaced so the process survives to report its modules.
    code = ("import os, sys, weightstream_command\n"
            "os.execv = lambda path, argv: print(path, 'weightstream' in sys.modules, 'torch' in sys.modules)\n"
            "weightstream_command.main()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    path, package_imported, torch_imported = run.stdout.split()
    assert path == weightstream_command.command_path()
    assert (package_imported, torch_imported) == ("False", "False")


def test_a_package_without_its_command_says_so(tmp_path):
    # A copy of the launcher beside no package: what a build without the command would give.
    launcher = tmp_path / "weightstream_command.py"
    launcher.write_text(Path(weightstream_command.__file__).read_text())
    run = subprocess.run([sys.executable, "-c", "import weightstream_command; weightstream_command.main()"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 1
    assert f"the command is not installed at {tmp_path}/weightstream/bin/weightstream" in run.stderr
