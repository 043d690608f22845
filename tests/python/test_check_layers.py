"""scripts/check-layers.py: the include rules of docs/ARCHITECTURE.md, read from its table of
layers, hold in this repository and catch each kind of violation."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "check-layers.py")

TABLE = """# Architecture

| layer | owns | public header | knows nothing of |
| --- | --- | --- | --- |
| `base` | errors | `error.hpp` | everything else |
| `device` | memory | `device.hpp` | storage |
| `model` | layouts | `model.hpp` | where bytes come from |
"""


def check(root):
    return subprocess.run([sys.executable, SCRIPT, str(root)], capture_output=True, text=True)


def tree(tmp_path, files):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ARCHITECTURE.md").write_text(TABLE)
    (tmp_path / "include" / "weightstream").mkdir(parents=True)
    for header in ("error.hpp", "device.hpp", "model.hpp"):
        (tmp_path / "include" / "weightstream" / header).write_text("#pragma once\n")
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


def test_this_repository_keeps_its_include_rules():
    result = check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 violation(s)" in result.stdout


def test_includes_of_shared_internals_and_layers_above_pass(tmp_path):
    root = tree(tmp_path, {
        "src/model/session.cpp": '#include "device/shared/copies.hpp"\n#include "weightstream/device.hpp"\n'
                                 '#include "base/text.hpp"\n#include "model/writer.hpp"\n',
        "src/device/shared/copies.hpp": '#include "weightstream/device.hpp"\n',
    })
    result = check(root)
    assert result.returncode == 0, result.stdout


def test_each_kind_of_violation_is_named_with_its_file_and_line(tmp_path):
    root = tree(tmp_path, {
        "src/model/session.cpp": '#include <vector>\n#include "device/copies.hpp"\n',
        "src/device/copy.cpp": '#include "weightstream/model.hpp"\n#include "model/shared/x.hpp"\n',
        "include/weightstream/extra.hpp": "#pragma once\n",
    })
    result = check(root)
    assert result.returncode == 1
    out = result.stdout
    assert ('src/model/session.cpp:2: "device/copies.hpp": an internal header of layer device '
            '(only device/shared/ is meant for other layers)') in out
    assert 'src/device/copy.cpp:1: "weightstream/model.hpp": layer device uses model, a layer below it' in out
    assert 'src/device/copy.cpp:2: "model/shared/x.hpp": layer device uses model, a layer below it' in out
    assert "include/weightstream/extra.hpp: a public header no layer of docs/ARCHITECTURE.md names" in out
    assert "4 violation(s)" in out


def test_a_layer_shared_whole_lends_every_header_to_the_layers_below(tmp_path):
    root = tree(tmp_path, {
        "src/model/session.cpp": '#include "device/socket.hpp"\n',
        "src/base/error.cpp": '#include "device/socket.hpp"\n',
    })
    (root / "docs" / "ARCHITECTURE.md").write_text(
        TABLE.replace("| `device.hpp` |", "| `device.hpp`; none other: every header is shared with the layers below |"))
    result = check(root)
    assert result.returncode == 1
    assert 'src/base/error.cpp:1: "device/socket.hpp": layer base uses device, a layer below it' in result.stdout
    assert "src/model/session.cpp" not in result.stdout
    assert "1 violation(s)" in result.stdout


def test_a_document_without_the_table_is_an_error(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ARCHITECTURE.md").write_text("# Architecture\n")
    result = check(tmp_path)
    assert result.returncode == 1
    assert "no table of layers in docs/ARCHITECTURE.md" in result.stderr
