"""Qwen3-Next at tensor-parallel sizes above 1: its Gated DeltaNet (linear_attn.*) layers are
divided as vLLM 0.33.0 divides them. A checkpoint written by transformers' save_pretrained
(Qwen3NextConfig, small and random) is exported rank by rank and compared

- with the slicing done by hand here (in_proj_qkvz and in_proj_ba contiguous rows, conv1d
  the rank's share of each of its q, k and v sections, A_log and dt_bias by value heads,
  norm whole, out_proj by columns), at tp 1, 2 and 4;
- with what vLLM's own QwenGatedDeltaNetAttention, built on the CPU (one gloo process a
  rank, as test_families_vllm.py builds its layers), loads through its parameters'
  weight_loader (mamba_v2_sharded_weight_loader for conv1d, sharded_weight_loader for A_log
  and dt_bias, MergedColumnParallelLinear and RowParallelLinear for the projections), at
  tp 2 and 4, dtype included (vLLM holds A_log in F32). vLLM 0.33.0 has no CPU platform
  here, so the one thing the rank script supplies is current_platform.current_device (the
  unspecified platform has none; the layer asks it where to put its gated norm).

It also audits the checkpoint on the CPU at every rank (on cuda:0 with a GPU) and checks the
error for a tp size that does not divide the linear-attention heads. Skips without torch or a
transformers that has Qwen3NextConfig; the vLLM comparison skips without vllm.
"""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import requires_cli, CLI

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
if not hasattr(transformers, "Qwen3NextConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3NextConfig", allow_module_level=True)

pytestmark = requires_cli

LINEAR = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight",
          "out_proj.weight")


def qwen3_next_config(**more):
    # Four layers: three Gated DeltaNet, the fourth full attention; 4 key and 8 value heads
    # (two value heads per key head, as the release has), so tp 4 holds one key head a rank.
    base = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=4,
                linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                shared_expert_intermediate_size=64, decoder_sparse_step=1, full_attention_interval=4,
                max_position_embeddings=256, tie_word_embeddings=False)
    base.update(more)
    return transformers.Qwen3NextConfig(**base)


def run(*args):
    result = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_next")
    torch.manual_seed(16)
    model = transformers.AutoModelForCausalLM.from_config(qwen3_next_config()).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="200KB")
    config = json.loads((directory / "config.json").read_text())
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(str(shard)))
    return directory, config, tensors


def linear_layers(config):
    return [i for i, kind in enumerate(config["layer_types"]) if kind == "linear_attention"]


def expected_linear_attention(config, t, tp, rank):
    """This rank's Gated DeltaNet parameters, sliced by hand as vLLM's loaders slice them."""
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]

    def rows(tensor, begin, count):
        return tensor[begin:begin + count]

    out = {}
    for layer in linear_layers(config):
        p = f"model.layers.{layer}.linear_attn."
        qkvz, ba = t[p + "in_proj_qkvz.weight"], t[p + "in_proj_ba.weight"]
        out[p + "in_proj_qkvz.weight"] = rows(qkvz, rank * qkvz.shape[0] // tp, qkvz.shape[0] // tp)
        out[p + "in_proj_ba.weight"] = rows(ba, rank * ba.shape[0] // tp, ba.shape[0] // tp)
        conv = t[p + "conv1d.weight"]
        q, k, v = conv[:key_dim], conv[key_dim:2 * key_dim], conv[2 * key_dim:]
        out[p + "conv1d.weight"] = torch.cat([rows(section, rank * section.shape[0] // tp, section.shape[0] // tp)
                                              for section in (q, k, v)])
        for name in ("A_log", "dt_bias"):
            heads = t[p + name].shape[0]
            out[p + name] = rows(t[p + name], rank * heads // tp, heads // tp)
        out[p + "A_log"] = out[p + "A_log"].float()
        out[p + "norm.weight"] = t[p + "norm.weight"]
        o = t[p + "out_proj.weight"]
        out[p + "out_proj.weight"] = o[:, rank * value_dim // tp:(rank + 1) * value_dim // tp]
    return out


def test_save_pretrained_writes_the_layout_the_tables_name(checkpoint):
    _, config, tensors = checkpoint
    assert config["model_type"] == "qwen3_next"
    assert linear_layers(config) == [0, 1, 2]
    key_dim, value_dim = 4 * 16, 8 * 16
    assert tuple(tensors["model.layers.0.linear_attn.conv1d.weight"].shape) == (2 * key_dim + value_dim, 1, 4)
    assert tuple(tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape) == (2 * key_dim + 2 * value_dim, 128)
    assert tensors["model.layers.0.linear_attn.A_log"].dtype == torch.bfloat16


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_export_equals_hand_slicing(checkpoint, tp, tmp_path):
    directory, config, tensors = checkpoint
    for rank in range(tp):
        out = tmp_path / f"rank{rank}.safetensors"
        run("export", directory, out, "--tp-size", tp, "--tp-rank", rank)
        exported = safetensors_torch.load_file(str(out))
        expected = expected_linear_attention(config, tensors, tp, rank)
        assert len(expected) == 3 * len(LINEAR)
        for name, value in expected.items():
            assert exported[name].dtype == value.dtype, f"tp {tp} rank {rank}: {name} is {exported[name].dtype}"
            assert exported[name].shape == value.shape, f"{name}: {tuple(exported[name].shape)} vs {tuple(value.shape)}"
            assert torch.equal(exported[name], value), f"tp {tp} rank {rank}: {name}"


@pytest.mark.parametrize("tp", [2, 4])
def test_audit_every_rank_is_clean(checkpoint, tp):
    directory, _, _ = checkpoint
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    for rank in range(tp):
        report = json.loads(run("audit", directory, "--device", device, "--tp-size", tp, "--tp-rank", rank,
                                "--batches", 8, "--order", "shuffled", "--json"))
        assert report["clean"] is True, (tp, rank, report)


def test_tp_size_that_cuts_a_linear_attention_head_is_refused(checkpoint, tmp_path):
    directory, config, _ = checkpoint
    # 4 attention heads divide among tp 4; 6 key heads (12 value heads) do not.
    odd = tmp_path / "odd"
    shutil.copytree(directory, odd)
    (odd / "config.json").write_text(json.dumps({**config, "linear_num_key_heads": 6, "linear_num_value_heads": 12}))
    result = subprocess.run([CLI, "export", str(odd), str(tmp_path / "out.safetensors"), "--tp-size", "4",
                             "--tp-rank", "1"], capture_output=True, text=True)
    assert result.returncode != 0
    assert ("qwen3_next tp 4: the Gated DeltaNet layers (layer 0 first) have 6 key heads (linear_num_key_heads) "
            "and 12 value heads (linear_num_value_heads), which do not both divide among tp_size 4") in result.stderr
    assert "use a tp_size that divides 6" in result.stderr


# ---- vLLM 0.33.0's own layers ----------------------------------------------------------------

RANK_SCRIPT = textwrap.dedent(r'''
    import json, sys, torch
    from pathlib import Path
    from safetensors.torch import load_file
    directory, export, rank, tp, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    from vllm.config import VllmConfig, DeviceConfig, ModelConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.platforms import current_platform
    model_config = ModelConfig(model=directory, tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16")
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    if getattr(current_platform, "current_device", None) is None:
        # The unspecified platform (no CPU platform in this vLLM build) cannot say where the
        # gated norm goes; on the CPU it is the CPU.
        current_platform.current_device = lambda: torch.device("cpu")
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=rank, backend="gloo")
        initialize_model_parallel(tp, 1)
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
        from vllm.model_executor.layers.linear import QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, ParallelLMHead
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader
        torch.set_default_dtype(torch.bfloat16)
        config = model_config.hf_config
        t = {}
        for shard in sorted(Path(directory).glob("*.safetensors")):
            t.update(load_file(str(shard)))
        ours = load_file(export)
        checked = []

        def compare(prefix, module, loads):
            # loads: (parameter name, checkpoint tensor, shard id or None), as vLLM's
            # AutoWeightsLoader and stacked-parameter mapping call the parameter's weight_loader.
            params = dict(module.named_parameters())
            for name, tensor, shard in loads:
                param = params[name]
                # A parameter without a weight_loader (the gated norm's) gets AutoWeightsLoader's default.
                loader = getattr(param, "weight_loader", default_weight_loader)
                if shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
            for name in dict.fromkeys(name for name, _, _ in loads):
                mine, theirs = ours[f"{prefix}.{name}"], params[name].data
                assert mine.dtype == theirs.dtype, (prefix, name, mine.dtype, theirs.dtype)
                assert mine.shape == theirs.shape, (prefix, name, mine.shape, theirs.shape)
                assert torch.equal(mine, theirs), (prefix, name)
                checked.append(f"{prefix}.{name}")

        h, heads, kv, head_dim = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        compare("model.embed_tokens", VocabParallelEmbedding(config.vocab_size, h),
                [("weight", t["model.embed_tokens.weight"], None)])
        compare("lm_head", ParallelLMHead(config.vocab_size, h), [("weight", t["lm_head.weight"], None)])
        for layer, kind in enumerate(config.layer_types):
            if kind == "linear_attention":
                p = f"model.layers.{layer}.linear_attn"
                gdn = QwenGatedDeltaNetAttention(config, vllm_config=vllm_config, prefix=p, gqa_interleaved_layout=True)
                compare(p, gdn, [(name, t[f"{p}.{name}"], None) for name in
                                 ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias",
                                  "norm.weight", "out_proj.weight")])
            else:
                # Qwen3NextAttention's projections: q_proj carries the query and its gate.
                p = f"model.layers.{layer}.self_attn"
                qkv = QKVParallelLinear(h, head_dim, heads * 2, kv, bias=False)
                compare(p + ".qkv_proj", qkv, [("weight", t[f"{p}.{part}_proj.weight"], part) for part in "qkv"])
                o = RowParallelLinear(heads * head_dim, h, bias=False)
                compare(p + ".o_proj", o, [("weight", t[f"{p}.o_proj.weight"], None)])
            s = f"model.layers.{layer}.mlp.shared_expert"
            inner = config.shared_expert_intermediate_size
            gate_up = MergedColumnParallelLinear(h, [inner, inner], bias=False)
            compare(s + ".gate_up_proj", gate_up, [("weight", t[s + ".gate_proj.weight"], 0),
                                                   ("weight", t[s + ".up_proj.weight"], 1)])
            compare(s + ".down_proj", RowParallelLinear(inner, h, bias=False),
                    [("weight", t[s + ".down_proj.weight"], None)])
        print(json.dumps({"rank": rank, "checked": checked}))
''')


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.parametrize("tp", [2, 4])
def test_export_equals_vllm_gated_deltanet_weight_loaders(checkpoint, tp, tmp_path):
    directory, config, _ = checkpoint
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()
    processes = []
    for rank in range(tp):
        export = tmp_path / f"rank{rank}.safetensors"
        run("export", directory, export, "--tp-size", tp, "--tp-rank", rank)
        processes.append(subprocess.Popen([sys.executable, str(script), str(directory), str(export), str(rank), str(tp),
                                           str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}))
    for process in processes:
        out, err = process.communicate(timeout=1500)
        assert process.returncode == 0, err[-4000:]
        checked = json.loads(out.strip().splitlines()[-1])["checked"]
        for layer in linear_layers(config):
            for name in LINEAR:
                assert f"model.layers.{layer}.linear_attn.{name}" in checked
        assert "model.layers.3.self_attn.qkv_proj.weight" in checked
