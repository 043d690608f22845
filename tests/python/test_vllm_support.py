"""What weightstream.vllm builds on, without vLLM or torch (numpy and safetensors only): a
stream of a subset of tensors, a layout's routes and skipped tensors, a tied parameter
sharing storage, and source resolution as `weightstream resolve` does it. The vLLM side
itself is tests/python/test_vllm.py (scripts/vllm-test.sh)."""

import json
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import weightstream  # noqa: E402
import weightstream.vllm as ws_vllm  # noqa: E402

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 256,
          "tie_word_embeddings": False, "torch_dtype": "float32"}


def llama_tensors(seed, extra=()):
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (256, 64), "model.norm.weight": (64,), "lm_head.weight": (256, 64),
              "model.layers.0.input_layernorm.weight": (64,), "model.layers.0.post_attention_layernorm.weight": (64,),
              "model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.k_proj.weight": (32, 64),
              "model.layers.0.self_attn.v_proj.weight": (32, 64), "model.layers.0.self_attn.o_proj.weight": (64, 64),
              "model.layers.0.mlp.gate_proj.weight": (128, 64), "model.layers.0.mlp.up_proj.weight": (128, 64),
              "model.layers.0.mlp.down_proj.weight": (64, 128)}
    shapes.update(dict(extra))
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


@pytest.fixture()
def checkpoint(tmp_path):
    tensors = llama_tensors(5, extra=[("model.layers.0.mlp.extra_bias", (8,))])
    safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path), tensors


def test_without_vllm_the_plugin_registers_nothing():
    if ws_vllm.vllm_version() is None:
        assert ws_vllm.register() is False


def test_stream_of_named_tensors_reads_only_those_in_file_order(checkpoint):
    path, tensors = checkpoint
    opened = weightstream.open(path)
    wanted = ["model.norm.weight", "lm_head.weight", "model.layers.0.mlp.extra_bias"]
    with opened.stream(names=wanted, framework="numpy") as stream:
        assert len(stream) == 3
        got = list(stream)
    assert [name for name, _ in got] == [name for name in opened.names if name in wanted]
    for name, array in got:
        assert np.array_equal(array, tensors[name])
    assert list(opened.stream(names=[])) == []
    with pytest.raises(KeyError, match="no tensor 'model.nope' in"):
        opened.stream(names=["model.nope"])


def test_layout_routes_checkpoint_tensors_and_skips_what_it_is_told(checkpoint):
    path, _ = checkpoint
    layout = weightstream.model_layout(CONFIG, dtype="F32")
    assert layout.route("model.layers.0.self_attn.k_proj.weight") == (
        "parameter", ["model.layers.0.self_attn.qkv_proj.weight"], "")
    assert layout.route("model.layers.0.mlp.extra_bias") == ("unmatched", [], "")
    layout.add_skipped_tensor("model.layers.0.mlp.extra_bias", "loaded by the model's load_weights")
    assert layout.route("model.layers.0.mlp.extra_bias") == ("skipped", [], "loaded by the model's load_weights")
    # The skipped tensor is left alone: the load plans without it and completes.
    layout.allocate("cpu")
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(path)
    session.finish()
    assert session.counters["parameters_completed"] == len(layout.parameter_names)


def test_skip_unmatched_skips_every_unmatched_tensor_of_a_checkpoint_in_one_call(checkpoint):
    path, _ = checkpoint
    layout = weightstream.model_layout(CONFIG, dtype="F32")
    opened = weightstream.open(path)
    reason = "loaded by the model's load_weights"
    assert layout.skip_unmatched(opened._core, reason) == ["model.layers.0.mlp.extra_bias"]
    assert layout.route("model.layers.0.mlp.extra_bias") == ("skipped", [], reason)
    # Again: nothing is unmatched now, and what it skipped for that reason is still named.
    assert layout.skip_unmatched(opened._core, reason) == ["model.layers.0.mlp.extra_bias"]
    assert layout.skip_unmatched(opened._core, "another reason") == []


def test_an_unskipped_unmatched_tensor_still_fails_the_load(checkpoint):
    path, _ = checkpoint
    layout = weightstream.model_layout(CONFIG, dtype="F32", device="cpu")
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    with pytest.raises(weightstream.Error, match="model.layers.0.mlp.extra_bias"):
        session.load_checkpoint(path)


def test_a_tied_parameter_shares_its_owner_storage():
    layout = weightstream.model_layout(dict(CONFIG, tie_word_embeddings=True), dtype="F32")
    with pytest.raises(weightstream.Error, match="model.embed_tokens.weight has no storage"):
        layout.share_storage("lm_head.weight", "model.embed_tokens.weight", "tied in the engine")
    layout.allocate("cpu")
    layout.share_storage("lm_head.weight", "model.embed_tokens.weight", "tied in the engine")
    address = np.from_dlpack(layout.tensor("lm_head.weight")).ctypes.data
    assert address == np.from_dlpack(layout.tensor("model.embed_tokens.weight")).ctypes.data
    with pytest.raises(weightstream.Error, match="cannot share parameter model.norm.weight"):
        layout.share_storage("model.norm.weight", "model.embed_tokens.weight", "wrong shape")


def test_resolve_source_falls_back_to_the_checkpoint_uri_naming_what_it_passed_over(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    snapshot = tmp_path_factory.mktemp("snapshot")
    (snapshot / "config.json").write_text(json.dumps(CONFIG))
    layout = weightstream.model_layout(CONFIG, dtype="F32")
    from weightstream import _core

    chosen = _core.resolve_source(str(snapshot), "", "target", layout, "", path)
    assert chosen["uri"] == path and chosen["field"] == "model_uri option"
    assert chosen["passed_over"] == ["model_weights: not set", f"model {snapshot}: no *.safetensors files"]
    assert "checkpoint" not in chosen
    # A loader that streams the source takes the checkpoint the resolution opened.
    opened = _core.resolve_source(str(snapshot), "", "target", layout, "", path, open_checkpoint=True)
    assert opened["uri"] == path and opened["passed_over"] == chosen["passed_over"]
    assert len(opened["checkpoint"]) == len(weightstream.open(path))
    assert opened["checkpoint"].find("lm_head.weight") is not None
    # One the loader opened ahead (while it bound the model) is taken as it is: no shard is
    # listed or read again, so it resolves even once the files are gone.
    ahead = weightstream.open(path)._core
    (Path(path) / "model.safetensors").rename(tmp_path_factory.mktemp("gone") / "model.safetensors")
    taken = _core.resolve_source(str(snapshot), "", "target", layout, "", path, open_checkpoint=True,
                                 opened=(path, ahead))
    assert taken["uri"] == path and len(taken["checkpoint"]) == len(ahead)
    with pytest.raises(weightstream.Error, match="no \\*.safetensors files"):
        _core.resolve_source(str(snapshot), "", "target", layout, "", path, open_checkpoint=True)
    with pytest.raises(weightstream.Error, match="Cannot find any safetensors model weights for the target: "
                                                 "model_weights: not set; model .*: no \\*.safetensors files"):
        _core.resolve_source(str(snapshot), "", "target", layout, "", "")


def test_checkpoint_uri_prefers_the_option_over_the_environment():
    from weightstream import _core

    assert _core.checkpoint_uri("s3://bucket/model") == ("s3://bucket/model", "model_uri option")
