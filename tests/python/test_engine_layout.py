"""Issue 48: one layout of a checkpoint everywhere. The command's layout (``weightstream plan
--json``) and the Python package's (``model_layout(..., hooks=True)``) are the library's one
engine_layout: the same parameters, filled by the same checkpoint slices, and the same model
hooks."""

import json
import subprocess

import pytest

from conftest import requires_cli, CLI

weightstream = pytest.importorskip("weightstream")

pytestmark = requires_cli


def synth(directory, arch):
    subprocess.run([CLI, "synth", str(directory), "--arch", arch, "--hidden", "256", "--vocab", "1000"], check=True,
                   capture_output=True)
    return str(directory)


def cli_layout(checkpoint, *flags):
    """The parameters and hooks of the command's layout, as plan --json prints them."""
    printed = json.loads(subprocess.run([CLI, "plan", checkpoint, "--json", *flags], check=True,
                                        capture_output=True, text=True).stdout)
    parameters = [(p["name"], p["dtype"], list(p["shape"]), p["layer"],
                   [(part["id"], part["tensor"], list(part["rows"]), list(part["columns"])) for part in p["parts"]])
                  for p in printed["parameters"]]
    return parameters, printed["hooks"]


def python_layout(layout):
    """The same fields of a Python layout."""
    parameters = []
    for name in layout.parameter_names:
        info = layout.parameter_info(name)
        parts = [(part["id"], part["tensor"], [part["row_begin"], part["rows"]],
                  [part["column_begin"], part["columns"]]) for part in info["parts"]]
        parameters.append((name, info["dtype"], list(info["shape"]), info["layer"], parts))
    return parameters, layout.hooks


@pytest.mark.parametrize("arch,tp_size,tp_rank", [("llama", 2, 1), ("deepseek_v3", 1, 0), ("qwen3_moe", 2, 0)])
def test_cli_and_python_layouts_are_equal(tmp_path, arch, tp_size, tp_rank):
    checkpoint = synth(tmp_path / arch, arch)
    cli_parameters, cli_hooks = cli_layout(checkpoint, "--tp-size", str(tp_size), "--tp-rank", str(tp_rank))
    layout = weightstream.model_layout(checkpoint, tp_size=tp_size, tp_rank=tp_rank, device="cpu", hooks=True)
    python_parameters, python_hooks = python_layout(layout)
    assert python_parameters == cli_parameters
    assert python_hooks == cli_hooks
    assert "fused_kv" in python_hooks  # the engine's derived K/V buffer (MLA's latent kv_a for DeepSeek)


def test_layout_without_hooks_takes_binds(tmp_path):
    checkpoint = synth(tmp_path / "llama", "llama")
    layout = weightstream.model_layout(checkpoint, device="cpu")
    assert layout.hooks == []
    assert sorted(layout.unbound_names) == sorted(layout.parameter_names)


def test_hooks_need_a_device(tmp_path):
    checkpoint = synth(tmp_path / "llama", "llama")
    with pytest.raises(weightstream.Error, match="hooks=True needs a device"):
        weightstream.model_layout(checkpoint, hooks=True)
