"""Issue 18: checkpoints written by Hugging Face transformers' save_pretrained, one per
supported family, exported at tp 1, 2, 4 and 8 and compared with vLLM-style slicing done
by hand here: fused qkv and gate_up, row and column parallel, the padded vocabulary, K/V
head replication, and experts stacked as w13 [E, 2I/tp, H] and w2 [E, H, I/tp]. Tiny
random configs: a vocabulary that is not a multiple of 64 and fewer K/V heads than the
largest tp. DeepSeek-V3 and GLM-4.5 checkpoints from save_pretrained have no MTP layers
while their configs count one: they load as targets.

Needs torch and transformers (skips cleanly without them); scripts/gpu.sh's `families`
stage runs it on the GPU machine.
"""

import json
import subprocess
from pathlib import Path

import pytest

from conftest import requires_cli, CLI

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = requires_cli

VOCAB = 1000  # not a multiple of 64
TPS = (1, 2, 4, 8)


def common(**more):
    base = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                tie_word_embeddings=False)
    base.update(more)
    return base


def family_configs():
    c = transformers
    moe = dict(moe_intermediate_size=64, num_experts_per_tok=2)
    mla = dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               num_key_value_heads=8, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
               n_group=1, topk_group=1, **moe)
    return {
        "llama": lambda: c.LlamaConfig(**common()),
        "qwen3": lambda: c.Qwen3Config(**common(head_dim=16)),
        "qwen3_moe": lambda: c.Qwen3MoeConfig(**common(head_dim=16, num_experts=8, decoder_sparse_step=1,
                                                       mlp_only_layers=[0], **moe)),
        "mixtral": lambda: c.MixtralConfig(**common(num_local_experts=8, num_experts_per_tok=2)),
        "deepseek_v3": lambda: c.DeepseekV3Config(**common(**mla)),
        "kimi_k2": lambda: c.DeepseekV3Config(**common(**mla)),
        "glm4_moe": lambda: c.Glm4MoeConfig(**common(head_dim=16, attention_bias=True, partial_rotary_factor=0.5,
                                                     n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                                                     n_group=1, topk_group=1, use_qk_norm=False, **moe)),
    }


def save_checkpoint(family, directory):
    config = family_configs()[family]()
    torch.manual_seed(18)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="200KB")
    config_path = Path(directory) / "config.json"
    text = json.loads(config_path.read_text())
    if family == "kimi_k2":
        text["model_type"] = "kimi_k2"  # Kimi-K2 ships DeepSeek-V3's classes under its own model_type
    if family in ("deepseek_v3", "kimi_k2", "glm4_moe"):
        text.setdefault("num_nextn_predict_layers", 1)  # as released; save_pretrained writes no MTP layer
    config_path.write_text(json.dumps(text))
    tensors = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(str(shard)))
    return text, tensors


# ---- vLLM-style slicing, by hand -----------------------------------------------------------

def rows(t, tp, rank):
    share = t.shape[0] // tp
    return t[rank * share:(rank + 1) * share]


def columns(t, tp, rank):
    share = t.shape[1] // tp
    return t[:, rank * share:(rank + 1) * share]


def vocab(t, tp, rank):
    padded = (t.shape[0] + 63) // 64 * 64
    share = padded // tp
    out = torch.zeros((share,) + tuple(t.shape[1:]), dtype=t.dtype)
    begin, end = min(rank * share, t.shape[0]), min((rank + 1) * share, t.shape[0])
    out[:end - begin] = t[begin:end]
    return out


def kv_heads(t, tp, rank, heads, head_dim):
    if tp <= heads:
        return rows(t, tp, rank)
    head = rank // (tp // heads)  # each head replicated on tp / heads ranks
    return t[head * head_dim:(head + 1) * head_dim]


def expected_rank(family, config, t, tp, rank):
    out = {}
    layers = config["num_hidden_layers"]
    hidden_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kvh = config["num_key_value_heads"]
    out["model.embed_tokens.weight"] = vocab(t["model.embed_tokens.weight"], tp, rank)
    out["lm_head.weight"] = vocab(t["lm_head.weight"], tp, rank)
    out["model.norm.weight"] = t["model.norm.weight"]
    mla = family in ("deepseek_v3", "kimi_k2")
    for layer in range(layers):
        p = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = t[p + norm + ".weight"]
        a = p + "self_attn."
        if mla:
            out[a + "fused_qkv_a_proj.weight"] = torch.cat([t[a + "q_a_proj.weight"], t[a + "kv_a_proj_with_mqa.weight"]])
            out[a + "q_a_layernorm.weight"] = t[a + "q_a_layernorm.weight"]
            out[a + "kv_a_layernorm.weight"] = t[a + "kv_a_layernorm.weight"]
            out[a + "q_b_proj.weight"] = rows(t[a + "q_b_proj.weight"], tp, rank)
            out[a + "kv_b_proj.weight"] = rows(t[a + "kv_b_proj.weight"], tp, rank)
        else:
            kv = lambda name: kv_heads(t[a + name], tp, rank, kvh, hidden_dim)
            out[a + "qkv_proj.weight"] = torch.cat([rows(t[a + "q_proj.weight"], tp, rank), kv("k_proj.weight"),
                                                     kv("v_proj.weight")])
            if a + "q_proj.bias" in t:
                out[a + "qkv_proj.bias"] = torch.cat([rows(t[a + "q_proj.bias"], tp, rank), kv("k_proj.bias"),
                                                       kv("v_proj.bias")])
            for norm in ("q_norm", "k_norm"):
                if a + norm + ".weight" in t:
                    out[a + norm + ".weight"] = t[a + norm + ".weight"]
        out[a + "o_proj.weight"] = columns(t[a + "o_proj.weight"], tp, rank)
        if family == "mixtral":
            m = p + "block_sparse_moe."
            names = ("w1", "w3", "w2")
        else:
            m = p + "mlp."
            names = ("gate_proj", "up_proj", "down_proj")
        expert0 = f"{m}experts.0.{names[0]}.weight"
        if expert0 in t:
            out[m + "gate.weight"] = t[m + "gate.weight"]
            if m + "gate.e_score_correction_bias" in t:
                out[m + "gate.e_score_correction_bias"] = t[m + "gate.e_score_correction_bias"].float()
            experts = sum(1 for name in t if name.startswith(m + "experts.") and name.endswith(names[2] + ".weight"))
            e = lambda i, n: t[f"{m}experts.{i}.{n}.weight"]
            out[m + "experts.w13_weight"] = torch.stack(
                [torch.cat([rows(e(i, names[0]), tp, rank), rows(e(i, names[1]), tp, rank)]) for i in range(experts)])
            out[m + "experts.w2_weight"] = torch.stack([columns(e(i, names[2]), tp, rank) for i in range(experts)])
            s = m + "shared_experts."
            if s + "gate_proj.weight" in t:
                out[s + "gate_up_proj.weight"] = torch.cat([rows(t[s + "gate_proj.weight"], tp, rank),
                                                            rows(t[s + "up_proj.weight"], tp, rank)])
                out[s + "down_proj.weight"] = columns(t[s + "down_proj.weight"], tp, rank)
        else:
            out[m + "gate_up_proj.weight"] = torch.cat([rows(t[m + "gate_proj.weight"], tp, rank),
                                                        rows(t[m + "up_proj.weight"], tp, rank)])
            out[m + "down_proj.weight"] = columns(t[m + "down_proj.weight"], tp, rank)
    return out


def run(*args):
    result = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


FAMILIES = list(family_configs().keys())


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    config, tensors = save_checkpoint(request.param, directory)
    return request.param, directory, config, tensors


def test_save_pretrained_checkpoint_has_no_mtp_layer(checkpoint):
    family, _, config, tensors = checkpoint
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert not [name for name in tensors if name.startswith(mtp)]


@pytest.mark.parametrize("tp", TPS)
def test_export_equals_vllm_style_slicing(checkpoint, tp, tmp_path):
    family, directory, config, tensors = checkpoint
    for rank in range(tp):
        out = tmp_path / f"rank{rank}.safetensors"
        run("export", directory, out, "--tp-size", tp, "--tp-rank", rank)
        exported = safetensors_torch.load_file(str(out))
        expected = expected_rank(family, config, tensors, tp, rank)
        assert sorted(exported) == sorted(expected), f"{family} tp {tp} rank {rank}"
        for name, value in expected.items():
            assert exported[name].shape == value.shape, f"{name}: {tuple(exported[name].shape)} vs {tuple(value.shape)}"
            assert torch.equal(exported[name], value.to(exported[name].dtype)), f"{family} tp {tp} rank {rank}: {name}"


def test_expert_parallel_keeps_experts_whole(checkpoint, tmp_path):
    family, directory, config, tensors = checkpoint
    if family in ("llama", "qwen3"):
        pytest.skip("a dense model")
    out = tmp_path / "ep.safetensors"
    run("export", directory, out, "--ep-size", 4, "--ep-rank", 3)
    exported = safetensors_torch.load_file(str(out))
    full = expected_rank(family, config, tensors, 1, 0)
    stacked = [name for name in full if name.endswith("experts.w13_weight") or name.endswith("experts.w2_weight")]
    assert stacked
    for name in stacked:
        assert torch.equal(exported[name], full[name][6:8]), name


def test_target_load_reads_no_mtp_bytes_and_draft_is_refused(checkpoint):
    family, directory, config, _ = checkpoint
    load = json.loads(run("load", directory, "--tp-size", 1, "--json"))
    assert load["bytes"] == load["checkpoint_bytes"]  # save_pretrained wrote no MTP layer: every byte is the target's
    if family not in ("deepseek_v3", "kimi_k2", "glm4_moe"):
        return
    result = subprocess.run([CLI, "load", str(directory), "--speculative", "mtp", "--json"], capture_output=True,
                            text=True)
    assert result.returncode != 0
    assert "Cannot find any safetensors model weights for the draft (mtp)" in result.stderr
    assert "no tensor the draft wants" in result.stderr


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "glm4_moe"])
def test_audit_on_cuda_at_tp2_is_clean(family, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("audit --device cuda:0 needs a GPU")
    config, _ = save_checkpoint(family, tmp_path)
    report = json.loads(run("audit", tmp_path, "--device", "cuda:0", "--tp-size", 2, "--order", "shuffled",
                            "--batches", 5, "--json"))
    assert report["clean"] is True, report


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "qwen3_moe"])
def test_fp8_block_audit_with_weight_and_scale_in_different_batches(family, tmp_path):
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    run("synth", tmp_path, "--arch", family, "--hidden", 512, "--quantize", "fp8-block", "--vocab", VOCAB)
    # Reversed order over many batches puts every weight_scale_inv in another batch than its weight.
    for order in ("reversed", "shuffled"):
        report = json.loads(run("audit", tmp_path, "--device", device, "--tp-size", 2, "--order", order,
                                "--batches", 9, "--json"))
        assert report["clean"] is True, report
    result = subprocess.run([CLI, "export", str(tmp_path), str(tmp_path / "x.safetensors"), "--tp-size", "8"],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "does not fall on the weight_block_size [128, 128] boundaries" in result.stderr or \
        "do not divide among tp_size 8" in result.stderr, result.stderr
