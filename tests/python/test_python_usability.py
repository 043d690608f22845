"""What a new user of the Python package meets first (issue 20): model_layout() given a
checkpoint directory or anything bad, module-level hooks at interpreter exit, stream()'s raw
bytes handed to LoadSession.load(), the weights iterator without torch, and the code of a
missing shard. Checkpoints come from `weightstream synth` with fixed seeds.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import parameter_bytes

np = pytest.importorskip("numpy")
weightstream = pytest.importorskip("weightstream")

try:
    import torch
except ImportError:
    torch = None

without_torch = pytest.mark.skipif(torch is not None, reason="checks the behaviour when torch is absent")


def synth(cli, directory, *args):
    result = subprocess.run([cli, "synth", str(directory), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return Path(directory)


@pytest.fixture(scope="module")
def llama_bf16(cli, tmp_path_factory):
    return synth(cli, tmp_path_factory.mktemp("llama_bf16"), "--arch", "llama", "--dtype", "bf16", "--seed", "4")


# ---- model_layout ------------------------------------------------------------------------------


def test_model_layout_takes_a_checkpoint_directory_or_uri(llama_bf16):
    from_checkpoint = weightstream.model_layout(weightstream.open(str(llama_bf16)))
    for config in (str(llama_bf16), llama_bf16, f"file://{llama_bf16}", str(llama_bf16 / "config.json")):
        layout = weightstream.model_layout(config)
        assert layout.parameter_names == from_checkpoint.parameter_names, config
        assert layout.description == from_checkpoint.description


def test_model_layout_raises_weightstream_errors_for_anything_bad(llama_bf16, tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(weightstream.Error, match=f"cannot read model config {missing}") as error:
        weightstream.model_layout(str(missing))
    assert error.value.code == "not_found"

    no_config = tmp_path / "weights_only"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(weightstream.Error, match="has no config.json") as error:
        weightstream.model_layout(no_config)
    assert error.value.code == "not_found"

    with pytest.raises(weightstream.Error) as error:
        weightstream.model_layout(tmp_path / "no_such_directory/")
    assert error.value.code == "not_found"

    bad_json = tmp_path / "config.json"
    bad_json.write_text("{ not json")
    with pytest.raises(weightstream.Error) as error:
        weightstream.model_layout(bad_json)
    assert error.value.code == "format"

    with pytest.raises(weightstream.Error, match="hidden_size is missing") as error:
        weightstream.model_layout({"model_type": "llama"})
    assert error.value.code == "format"
    unknown = json.loads((llama_bf16 / "config.json").read_text())
    unknown["model_type"] = "gpt_neo_forever"
    with pytest.raises(weightstream.Error, match="gpt_neo_forever") as error:
        weightstream.model_layout(unknown)
    assert error.value.code in ("model", "unsupported")
    with pytest.raises(TypeError, match="config must be"):
        weightstream.model_layout(42)


def test_model_layout_docstring_lists_every_architecture():
    for architecture in ("llama", "qwen3", "qwen3_next", "deepseek_v3"):
        assert architecture in weightstream.model_layout.__doc__


# ---- hooks at exit -----------------------------------------------------------------------------


def test_a_module_level_hook_leaks_nothing_at_exit(llama_bf16, tmp_path):
    # The docs/PYTHON.md pattern: a module-level layout whose hook refers to it.
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import weightstream
        checkpoint = weightstream.open({str(llama_bf16)!r})
        layout = weightstream.model_layout(checkpoint, device="cpu")
        runs = []
        layout.add_hook("refresh_kv", lambda: runs.append(layout.loads_finished))
        session = weightstream.LoadSession(layout)
        session.begin("cold")
        session.load_checkpoint(checkpoint)
        session.finish()
        assert runs == [0], runs
        print("loaded")
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "loaded"
    assert "leaked" not in result.stderr and "nanobind" not in result.stderr, result.stderr


# ---- LoadSession.load with stream()'s raw bytes -------------------------------------------------


@without_torch
def test_raw_bytes_from_our_own_stream_load_without_a_dtype(llama_bf16):
    checkpoint = weightstream.open(str(llama_bf16))
    reference = weightstream.model_layout(checkpoint, device="cpu")
    session = weightstream.LoadSession(reference)
    session.begin("cold")
    session.load_checkpoint(checkpoint)
    session.finish()

    layout = weightstream.model_layout(checkpoint, device="cpu")
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    for name, tensor in weightstream.stream(str(llama_bf16)):
        assert checkpoint.dtypes[name] == "BF16" and np.from_dlpack(tensor).shape[-1] == 2  # raw bytes
        session.load([(name, tensor)])  # no dtype named
    session.finish()
    assert parameter_bytes(layout) == parameter_bytes(reference)


@without_torch
def test_raw_looking_bytes_from_elsewhere_get_the_fix_in_the_error(llama_bf16):
    checkpoint = weightstream.open(str(llama_bf16))
    layout = weightstream.model_layout(checkpoint, device="cpu")
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    name = "model.layers.0.self_attn.q_proj.weight"
    copied = np.array(np.from_dlpack(next(t for n, t in checkpoint.stream() if n == name)))  # not our memory
    with pytest.raises(weightstream.Error) as error:
        session.load([(name, copied)])
    message = str(error.value)
    assert f"tensor '{name}' came as uint8 [" in message
    assert 'name its dtype: (name, tensor, "BF16")' in message
    session.begin("cold")  # a session whose batch failed begins anew
    session.load([(name, copied, "BF16")])  # the fix works


# ---- the weights iterator without torch --------------------------------------------------------


@without_torch
def test_weights_iterator_without_torch_says_it_yields_torch_tensors(llama_bf16):
    with pytest.raises(ImportError) as error:
        next(weightstream.safetensors_weights_iterator(str(llama_bf16)))
    message = str(error.value)
    assert "safetensors_weights_iterator yields torch tensors" in message and "needs PyTorch" in message
    assert "framework=" not in message


# ---- error codes -------------------------------------------------------------------------------


def test_a_missing_shard_is_not_found(llama_bf16, tmp_path):
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    directory = tmp_path / "sharded"
    directory.mkdir()
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "model-00001-of-00002.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(weightstream.Error, match="'model-00002-of-00002.safetensors', which does not exist") as error:
        weightstream.open(str(directory))
    assert error.value.code == "not_found"


# ---- a layout's parameters as views -------------------------------------------------------------


def test_a_layouts_parameters_come_as_dlpack_numpy_or_torch_views_of_its_storage(cli, llama_bf16, tmp_path):
    """layout.tensor(name, framework) and layout.tensors(framework): one parameter or all, in
    layout order, as views of the layout's storage (a write through one shows in the others),
    BF16 and FP8 block-scaled, with the parameter's dtype and shape; a bad framework is refused."""
    fp8 = synth(cli, tmp_path / "fp8", "--arch", "llama", "--quantize", "fp8-block", "--seed", "5")
    for directory in (llama_bf16, fp8):
        layout = weightstream.model_layout(str(directory), device="cpu")
        session = weightstream.LoadSession(layout)
        session.begin("cold")
        session.load_checkpoint(str(directory))
        session.finish()
        names = [name for name, _, _ in layout.parameters]
        stored = parameter_bytes(layout)
        arrays = layout.tensors()
        assert list(arrays) == names
        assert all(hasattr(arrays[name], "__dlpack__") for name in names)
        assert layout.tensor(names[0]).__dlpack_device__() == arrays[names[0]].__dlpack_device__()
        as_numpy = layout.tensors("numpy")
        assert list(as_numpy) == names
        for name in names:
            assert as_numpy[name].tobytes() == stored[name], name
            assert layout.tensor(name, "numpy").tobytes() == stored[name], name
        if torch is not None:
            as_torch = layout.tensors("torch")
            assert list(as_torch) == names
            for name, dtype, shape in layout.parameters:
                tensor = as_torch[name]
                assert isinstance(tensor, torch.Tensor), name
                assert tuple(tensor.shape) == tuple(shape), name
                assert tensor.element_size() * tensor.numel() == len(stored[name]), name
                assert tensor.view(torch.uint8).numpy().tobytes() == stored[name], name
                assert layout.tensor(name, "torch").data_ptr() == tensor.data_ptr(), name
            first = names[0]
            as_torch[first].view(torch.uint8).view(-1)[0] ^= 0xFF  # through torch, seen by numpy
            assert layout.tensor(first, "numpy").tobytes()[0] == stored[first][0] ^ 0xFF
        with pytest.raises(ValueError, match="framework must be None, 'torch' or 'numpy', not 'jax'"):
            layout.tensor(names[0], "jax")
        with pytest.raises(ValueError, match="framework must be None, 'torch' or 'numpy', not 'jax'"):
            layout.tensors("jax")
