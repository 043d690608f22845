"""The engines' names of layout parameters, from one declarative table
(python/weightstream/_engine/renames.py): vLLM's and SGLang's, for targets and MTP drafts."""
import importlib.util
import os
import sys

import pytest

weightstream = pytest.importorskip("weightstream")


def load_renames():
    # The table needs no torch; the _engine package around it does, so it is loaded alone.
    path = os.path.join(os.path.dirname(weightstream.__file__), "_engine", "renames.py")
    spec = importlib.util.spec_from_file_location("weightstream_engine_renames", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


renames = load_renames()


@pytest.mark.parametrize("layout_name,role,model_type,expected", [
    # A target's names are the layout's; stacked experts first under vLLM 0.33's RoutedExperts.
    ("model.layers.0.self_attn.qkv_proj.weight", "target", "llama", ["model.layers.0.self_attn.qkv_proj.weight"]),
    ("model.layers.3.mlp.experts.w13_weight", "target", "qwen3_moe",
     ["model.layers.3.mlp.experts.routed_experts.w13_weight", "model.layers.3.mlp.experts.w13_weight"]),
    ("model.layers.3.mlp.experts.w2_weight_scale_inv", "target", "deepseek_v3",
     ["model.layers.3.mlp.experts.routed_experts.w2_weight_scale_inv", "model.layers.3.mlp.experts.w2_weight_scale_inv"]),
    # A target's layer of a DeepSeek model is never renamed as a draft's would be.
    ("model.layers.3.self_attn.o_proj.weight", "target", "deepseek_v3", ["model.layers.3.self_attn.o_proj.weight"]),
    # DeepSeek-V3's MTP layer: its own modules stay, the decoder layer nests under mtp_block,
    # the embedding is the draft's model.embed_tokens.
    ("model.layers.61.enorm.weight", "draft", "deepseek_v3", ["model.layers.61.enorm.weight"]),
    ("model.layers.61.shared_head.norm.weight", "draft", "glm4_moe", ["model.layers.61.shared_head.norm.weight"]),
    ("model.layers.61.embed_tokens.weight", "draft", "deepseek_v3", ["model.embed_tokens.weight"]),
    ("model.layers.61.self_attn.o_proj.weight", "draft", "kimi_k2",
     ["model.layers.61.mtp_block.self_attn.o_proj.weight"]),
    ("model.layers.61.mlp.experts.w13_weight", "draft", "deepseek_v3",
     ["model.layers.61.mtp_block.mlp.experts.routed_experts.w13_weight",
      "model.layers.61.mtp_block.mlp.experts.w13_weight"]),
    # Qwen3-Next's mtp.* lives under model.*; a family without a DeepSeek MTP keeps its names.
    ("mtp.fc.weight", "draft", "qwen3_next", ["model.fc.weight"]),
    ("model.layers.2.mlp.gate_up_proj.weight", "draft", "llama", ["model.layers.2.mlp.gate_up_proj.weight"]),
])
def test_vllm_names(layout_name, role, model_type, expected):
    assert renames.engine_names("vllm", layout_name, role, model_type) == expected


def test_vllm_names_before_the_experts_stage():
    assert renames.engine_names("vllm", "model.layers.61.mlp.experts.w2_weight", "draft", "deepseek_v3",
                                stages=("draft",)) == ["model.layers.61.mtp_block.mlp.experts.w2_weight"]


@pytest.mark.parametrize("layout_name,role,expected", [
    ("model.layers.0.mlp.experts.w13_weight", "target", ["model.layers.0.mlp.experts.w13_weight"]),
    # MLA's fused q_a_proj and kv_a_proj_with_mqa.
    ("model.layers.0.self_attn.fused_qkv_a_proj.weight", "target",
     ["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"]),
    # The NextN draft: own modules under model.*, the decoder layer under model.decoder.*, the
    # shared head's projection the draft's lm_head.
    ("model.layers.61.eh_proj.weight", "draft", ["model.eh_proj.weight"]),
    ("model.layers.61.shared_head.norm.weight", "draft", ["model.shared_head.norm.weight"]),
    ("model.layers.61.embed_tokens.weight", "draft", ["model.embed_tokens.weight"]),
    ("model.layers.61.shared_head.head.weight", "draft", ["lm_head.weight"]),
    ("model.layers.61.self_attn.fused_qkv_a_proj.weight_scale_inv", "draft",
     ["model.decoder.self_attn.fused_qkv_a_proj_with_mqa.weight_scale_inv"]),
    ("model.layers.61.mlp.experts.w2_weight", "draft", ["model.decoder.mlp.experts.w2_weight"]),
])
def test_sglang_names(layout_name, role, expected):
    assert renames.engine_names("sglang", layout_name, role) == expected
