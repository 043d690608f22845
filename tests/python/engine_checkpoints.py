"""Checkpoints for the engine stages (tests/python/test_vllm_models.py,
tests/python/test_sglang_models.py, bench/vllm_moe_bench.py): a small model of each family
weightstream binds, written by transformers' ``save_pretrained`` from a seed (BF16), or FP8
block-scaled from those BF16 weights: every weight the engines quantize becomes E4M3 codes
with one F32 ``weight_scale_inv`` per 128 x 128 block (scale = amax / 448), and config.json
gets the quantization_config DeepSeek-V3 ships. And what one rank of a layout reads of them.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

# ---- the families -----------------------------------------------------------------------

# Dimensions every block-quantized weight divides into whole 128 x 128 blocks at tp 2, as
# vLLM's validate_fp8_block_shape requires: 128-wide heads, 512-wide MLPs, 256-wide experts.
_COMMON = dict(vocab_size=1000, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
               intermediate_size=512, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-6,
               tie_word_embeddings=False)
_MOE = dict(moe_intermediate_size=256, num_experts_per_tok=2)
_DEEPSEEK = dict(n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                 q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                 num_nextn_predict_layers=0, rope_scaling=None, routed_scaling_factor=1.0,
                 topk_method="noaux_tc", scoring_func="sigmoid")

FAMILIES: Dict[str, Dict[str, Any]] = {
    "llama": dict(cls="LlamaConfig", model="LlamaForCausalLM", config=dict(_COMMON)),
    "qwen3": dict(cls="Qwen3Config", model="Qwen3ForCausalLM", config=dict(_COMMON)),
    "qwen3_moe": dict(cls="Qwen3MoeConfig", model="Qwen3MoeForCausalLM",
                      config=dict(_COMMON, **_MOE, num_experts=8, mlp_only_layers=[0], decoder_sparse_step=1)),
    "mixtral": dict(cls="MixtralConfig", model="MixtralForCausalLM",
                    config=dict(_COMMON, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": dict(cls="DeepseekV3Config", model="DeepseekV3ForCausalLM",
                        config=dict(_COMMON, **_MOE, **_DEEPSEEK)),
    # Kimi-K2 is DeepSeek-V3's architecture under its own model_type (vLLM maps it so).
    "kimi_k2": dict(cls="DeepseekV3Config", model="DeepseekV3ForCausalLM",
                    config=dict(_COMMON, **_MOE, **_DEEPSEEK), model_type="kimi_k2"),
    "glm4_moe": dict(cls="Glm4MoeConfig", model="Glm4MoeForCausalLM",
                     config=dict(_COMMON, **_MOE, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                                 n_group=1, topk_group=1, partial_rotary_factor=0.5, attention_bias=True,
                                 use_qk_norm=False, num_nextn_predict_layers=0, routed_scaling_factor=1.0)),
    "qwen3_next": dict(cls="Qwen3NextConfig", model="Qwen3NextForCausalLM",
                       config=dict(_COMMON, **_MOE, num_experts=8, shared_expert_intermediate_size=256,
                                   decoder_sparse_step=1, mlp_only_layers=[], linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                                   linear_conv_kernel_dim=4, full_attention_interval=2,
                                   layer_types=["linear_attention", "full_attention"])),
}

MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2", "glm4_moe", "qwen3_next")

#: Checkpoint modules whose weight vLLM's FP8 block method quantizes (linear layers built with
#: the quant_config); routers, norms, embeddings, lm_head and conv1d stay as they are.
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
              "kv_a_proj_with_mqa", "kv_b_proj", "w1", "w2", "w3", "in_proj_qkvz", "in_proj_ba", "out_proj", "fc")

#: Modules an FP8 checkpoint here leaves unquantized and lists in modules_to_not_convert.
_UNQUANTIZED = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".linear_attn.in_proj_ba.weight")

FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def quantized_name(name: str) -> bool:
    """Whether an FP8 block-scaled checkpoint ships this tensor as E4M3 codes."""
    if not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")]
    return module.rsplit(".", 1)[-1] in _QUANTIZED and ".shared_expert_gate" not in module


def quantize_blocks(weight: torch.Tensor, block: int = 128) -> Tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes and F32 scales of a 2-D weight, block by block: scale = amax / 448 (1 for
    an all-zero block), code = E4M3(value / scale)."""
    values = weight.to(torch.float32)
    rows, columns = values.shape
    block_rows, block_columns = -(-rows // block), -(-columns // block)
    scales = torch.empty(block_rows, block_columns, dtype=torch.float32)
    codes = torch.empty(rows, columns, dtype=torch.float8_e4m3fn)
    for r in range(block_rows):
        for c in range(block_columns):
            tile = values[r * block:(r + 1) * block, c * block:(c + 1) * block]
            amax = tile.abs().max()
            scale = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scales[r, c] = scale
            codes[r * block:(r + 1) * block, c * block:(c + 1) * block] = (tile / scale).to(torch.float8_e4m3fn)
    return codes, scales


#: Families whose checkpoints ship multi-token-prediction (draft) layers.
MTP_FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_next")


def write_checkpoint(family: str, folder: str, seed: int, fp8: bool = False, shard_size: str = "2MB",
                     mtp: bool = False, config_overrides: Optional[Dict[str, Any]] = None,
                     saved_overrides: Optional[Dict[str, Any]] = None) -> str:
    """Writes a small ``family`` model with transformers' save_pretrained (random weights from
    ``seed``, BF16, sharded); with ``fp8`` the same weights FP8 block-scaled; with ``mtp`` one
    MTP layer beside the target's, named as the family's releases name it. ``config_overrides``
    change the transformers config the model is built from, ``saved_overrides`` are written
    into config.json after (keys transformers no longer writes). Returns folder."""
    import transformers  # noqa: PLC0415
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    spec = FAMILIES[family]
    settings = dict(spec["config"], **(config_overrides or {}))
    layers = settings["num_hidden_layers"]
    if mtp:
        # The MTP layer's decoder part is one more decoder layer (full attention, experts).
        settings["num_hidden_layers"] = layers + 1
        if "layer_types" in settings:
            settings["layer_types"] = list(settings["layer_types"]) + ["full_attention"]
    config = getattr(transformers, spec["cls"])(**settings)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = getattr(transformers, spec["model"])(config)
    # Norm weights start at one: random ones make the comparison cover them too.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.05)
    model = model.to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=shard_size)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as file:
        saved = json.load(file)
    if "model_type" in spec:
        saved["model_type"] = spec["model_type"]
    saved.update(saved_overrides or {})
    if mtp:
        _add_mtp_layer(folder, saved, family, layers, seed)
    if fp8:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        # Routers stay unquantized, as released FP8 MoE checkpoints keep them; vLLM's
        # Qwen3-MoE would quantize its router unless told so, by full module name.
        # Qwen3-Next's in_proj_ba (a few rows per rank) too: vLLM refuses to divide it in blocks.
        unquantized = sorted(name[: -len(".weight")] for name in _checkpoint_itemsizes(folder)
                             if name.endswith(_UNQUANTIZED))
        saved["quantization_config"] = dict(FP8_QUANTIZATION, modules_to_not_convert=unquantized)
        index_path = os.path.join(folder, "model.safetensors.index.json")
        weight_map: Dict[str, str] = {}
        for file in files:
            tensors = load_file(os.path.join(folder, file))
            out: Dict[str, torch.Tensor] = {}
            for name, tensor in tensors.items():
                if quantized_name(name) and tensor.dim() == 2 and not name.endswith(_UNQUANTIZED):
                    out[name], out[name + "_scale_inv"] = quantize_blocks(tensor)
                else:
                    out[name] = tensor
            save_file(out, os.path.join(folder, file), metadata={"format": "pt"})
            weight_map.update({name: file for name in out})
        if os.path.exists(index_path):
            with open(index_path) as file:
                index = json.load(file)
            index["weight_map"] = weight_map
            with open(index_path, "w") as file:
                json.dump(index, file)
    with open(config_path, "w") as file:
        json.dump(saved, file, indent=2)
    return folder


def _add_mtp_layer(folder: str, saved: Dict[str, Any], family: str, layers: int, seed: int) -> None:
    """Turns the last decoder layer save_pretrained wrote into the MTP layer and adds the MTP
    module's own tensors: DeepSeek-V3 and GLM-4.5 keep it as model.layers.{layers}.* with
    embed_tokens, enorm, hnorm, eh_proj and shared_head; Qwen3-Next as mtp.layers.0.* with
    mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden and mtp.norm."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    hidden, vocab = saved["hidden_size"], saved["vocab_size"]
    generator = torch.Generator().manual_seed(seed + 1000)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.05).to(torch.bfloat16)

    prefix = f"model.layers.{layers}."
    if family == "qwen3_next":
        extra = {"mtp.fc.weight": rand(hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": rand(hidden),
                 "mtp.pre_fc_norm_hidden.weight": rand(hidden), "mtp.norm.weight": rand(hidden)}
        rename = lambda name: "mtp.layers.0." + name[len(prefix):] if name.startswith(prefix) else name  # noqa: E731
        saved["layer_types"] = saved["layer_types"][:layers]
        saved["num_nextn_predict_layers"] = 1
    else:
        extra = {prefix + "embed_tokens.weight": rand(vocab, hidden), prefix + "enorm.weight": rand(hidden),
                 prefix + "hnorm.weight": rand(hidden), prefix + "eh_proj.weight": rand(hidden, 2 * hidden),
                 prefix + "shared_head.norm.weight": rand(hidden), prefix + "shared_head.head.weight": rand(vocab, hidden)}
        rename = lambda name: name  # noqa: E731
        saved["num_nextn_predict_layers"] = 1
    saved["num_hidden_layers"] = layers
    weight_map: Dict[str, str] = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        tensors = {rename(name): tensor for name, tensor in load_file(os.path.join(folder, file)).items()}
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
    save_file(extra, os.path.join(folder, "model-mtp.safetensors"), metadata={"format": "pt"})
    weight_map.update({name: "model-mtp.safetensors" for name in extra})
    index_path = os.path.join(folder, "model.safetensors.index.json")
    with open(index_path) as file:
        index = json.load(file)
    index["weight_map"] = weight_map
    with open(index_path, "w") as file:
        json.dump(index, file)


def checkpoint_tensors(folder: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, by name."""
    from safetensors.torch import load_file  # noqa: PLC0415

    tensors: Dict[str, torch.Tensor] = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, file)))
    return tensors


def write_changed_variant(source: str, folder: str, fraction: float, seed: int,
                          bf16_source: Optional[str] = None) -> str:
    """Writes into ``folder`` a copy of checkpoint ``source`` in which a random ``fraction`` of
    the elements of every floating-point weight changed (one file, ``source``'s config): what
    one RL step leaves of a model. An FP8 block-scaled ``source`` is quantized from its BF16
    twin ``bf16_source`` changed so, and ``folder``-bf16 (the changed BF16 weights a trainer
    holds) is written beside it. Returns folder."""
    import shutil  # noqa: PLC0415

    from safetensors.torch import save_file  # noqa: PLC0415

    generator = torch.Generator().manual_seed(seed)

    def changed(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        out = {}
        for name, tensor in sorted(tensors.items()):
            if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                out[name] = tensor
                continue
            mask = torch.rand(tensor.shape, generator=generator) < fraction
            # Shrunk, never grown: a block's amax (its FP8 scale) moves only where its largest
            # element is among the changed ones, as small training steps leave most scales.
            bumped = (tensor.to(torch.float32) * 0.9).to(tensor.dtype)
            out[name] = torch.where(mask, bumped, tensor).contiguous()
        return out

    def copy_config(into: str) -> None:
        os.makedirs(into, exist_ok=True)
        for file in os.listdir(source):
            if not file.endswith(".safetensors") and file != "model.safetensors.index.json":
                shutil.copy(os.path.join(source, file), os.path.join(into, file))

    copy_config(folder)
    if bf16_source is None:
        save_file(changed(checkpoint_tensors(source)), os.path.join(folder, "model.safetensors"),
                  metadata={"format": "pt"})
        return folder
    quantized = {name[: -len("_scale_inv")] for name in checkpoint_tensors(source) if name.endswith("_scale_inv")}
    weights = changed(checkpoint_tensors(bf16_source))
    os.makedirs(folder + "-bf16", exist_ok=True)
    save_file(weights, os.path.join(folder + "-bf16", "model.safetensors"), metadata={"format": "pt"})
    out: Dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name in quantized:
            out[name], out[name + "_scale_inv"] = quantize_blocks(tensor)
        else:
            out[name] = tensor
    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def rank_bytes(layout: Any, folder: str) -> Tuple[int, int]:
    """(share, planned) of a rank: the bytes of the checkpoint slices its parameters take, and
    the bytes weightstream's plan reads for them: a tensor feeding one part is read as that
    slice (its rows as one range, its columns of a row-split tensor as a run per row), one
    split in sections as a range per section; only a tensor whose parts share rows is read
    whole."""
    from safetensors import safe_open  # noqa: PLC0415

    itemsizes = _checkpoint_itemsizes(folder)
    shapes: Dict[str, List[int]] = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file), "pt") as handle:
                shapes.update({name: handle.get_slice(name).get_shape() for name in handle.keys()})
    parts: Dict[str, List[Dict[str, Any]]] = {}
    for name in layout.parameter_names:
        for part in layout.parameter_info(name)["parts"]:
            parts.setdefault(part["tensor"], []).append(part)
    share = planned = 0
    for tensor, tensor_parts in parts.items():
        shape = shapes[tensor]
        columns = 1
        for dimension in shape[1:]:
            columns *= dimension
        whole = (shape[0] if shape else 1) * columns * itemsizes[tensor]
        sliced = sum(part["rows"] * part["columns"] * itemsizes[tensor] for part in tensor_parts)
        share += sliced
        rows = sorted((part["row_begin"], part["row_begin"] + part["rows"]) for part in tensor_parts if part["rows"])
        disjoint_sections = all(part["columns"] == columns for part in tensor_parts) and \
            all(end <= begin for (_, end), (begin, _) in zip(rows, rows[1:]))
        planned += (sliced if len(tensor_parts) == 1 or disjoint_sections else whole) if sliced else 0
    return share, planned


def _checkpoint_itemsizes(folder: str) -> Dict[str, int]:
    """Every tensor of a checkpoint folder: the bytes of one element."""
    from safetensors import safe_open  # noqa: PLC0415

    sizes = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F64": 8, "I64": 8, "I32": 4}
    itemsizes: Dict[str, int] = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file), "pt") as handle:
                for name in handle.keys():
                    itemsizes[name] = sizes[handle.get_slice(name).get_dtype()]
    return itemsizes


