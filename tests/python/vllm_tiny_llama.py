"""A small Llama made of vLLM's real layers, for tests/python/test_vllm.py.

``TinyLlama`` has the parameter names of vLLM's LlamaForCausalLM and is built from
QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
ParallelLMHead and RMSNorm, so at tensor-parallel size N each rank holds exactly the slices
vLLM's own model holds. Its ``load_weights`` fills them through each parameter's own
``weight_loader``, as vLLM's LlamaModel.load_weights does (q/k/v and gate/up stacked into
their fused parameters): the reference a weightstream load is compared with.

Checkpoints are written with the safetensors package from a fixed seed. Everything here
needs vLLM and must run inside ``set_current_vllm_config`` after vLLM's parallel state is
initialized (``distributed``).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Iterable, Iterator, Set, Tuple

import torch
from torch import nn

CONFIG: Dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def hf_tensors(config: Dict[str, Any], seed: int) -> Dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face Llama checkpoint of ``config``, random from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_rows, kv_rows = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32)

    tensors = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden), "model.norm.weight": rand(hidden)}
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = rand(config["vocab_size"], hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors.update({
            prefix + "input_layernorm.weight": rand(hidden),
            prefix + "post_attention_layernorm.weight": rand(hidden),
            prefix + "self_attn.q_proj.weight": rand(q_rows, hidden),
            prefix + "self_attn.k_proj.weight": rand(kv_rows, hidden),
            prefix + "self_attn.v_proj.weight": rand(kv_rows, hidden),
            prefix + "self_attn.o_proj.weight": rand(hidden, q_rows),
            prefix + "mlp.gate_proj.weight": rand(inter, hidden),
            prefix + "mlp.up_proj.weight": rand(inter, hidden),
            prefix + "mlp.down_proj.weight": rand(hidden, inter),
        })
    return tensors


def write_checkpoint(folder: str, config: Dict[str, Any], seed: int, shards: int = 2) -> Dict[str, torch.Tensor]:
    """Writes config.json, ``shards`` safetensors files and their index; returns the tensors."""
    from safetensors.torch import save_file  # noqa: PLC0415

    os.makedirs(folder, exist_ok=True)
    tensors = hf_tensors(config, seed)
    names = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name].contiguous() for name in names[shard::shards]}
        save_file(part, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map},
                  handle)
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(config, handle)
    return tensors


class _Attention(nn.Module):
    def __init__(self, config: Dict[str, Any], prefix: str) -> None:
        super().__init__()
        from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear  # noqa: PLC0415

        head_dim = config["head_dim"]
        self.qkv_proj = QKVParallelLinear(config["hidden_size"], head_dim, config["num_attention_heads"],
                                          config["num_key_value_heads"], bias=False, prefix=prefix + ".qkv_proj")
        self.o_proj = RowParallelLinear(config["num_attention_heads"] * head_dim, config["hidden_size"], bias=False,
                                        prefix=prefix + ".o_proj")


class _Mlp(nn.Module):
    def __init__(self, config: Dict[str, Any], prefix: str) -> None:
        super().__init__()
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear  # noqa: PLC0415

        self.gate_up_proj = MergedColumnParallelLinear(config["hidden_size"], [config["intermediate_size"]] * 2,
                                                       bias=False, prefix=prefix + ".gate_up_proj")
        self.down_proj = RowParallelLinear(config["intermediate_size"], config["hidden_size"], bias=False,
                                           prefix=prefix + ".down_proj")


class _DecoderLayer(nn.Module):
    def __init__(self, config: Dict[str, Any], prefix: str) -> None:
        super().__init__()
        from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: PLC0415

        self.self_attn = _Attention(config, prefix + ".self_attn")
        self.mlp = _Mlp(config, prefix + ".mlp")
        self.input_layernorm = RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])


class _LlamaModel(nn.Module):
    def __init__(self, config: Dict[str, Any]) -> None:
        super().__init__()
        from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: PLC0415
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding  # noqa: PLC0415

        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(_DecoderLayer(config, f"model.layers.{i}") for i in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])


# (fused parameter, checkpoint name, shard id), as vLLM's LlamaModel.load_weights stacks them.
_STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


class TinyLlama(nn.Module):
    """vLLM's LlamaForCausalLM's parameters, made of vLLM's layers (no attention backend)."""

    def __init__(self, config: Dict[str, Any]) -> None:
        super().__init__()
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead  # noqa: PLC0415

        self.config = config
        self.model = _LlamaModel(config)
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"])
        if config.get("tie_word_embeddings"):
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Each parameter's own weight_loader, as vLLM's Llama does; returns the names loaded."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: PLC0415

        params = dict(self.named_parameters())
        loaded: Set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.get("tie_word_embeddings") and name.startswith("lm_head."):
                continue
            for fused, part, shard in _STACKED:
                if part in name:
                    name = name.replace(part, fused)
                    param = params[name]
                    param.weight_loader(param, tensor, shard)
                    break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        if self.config.get("tie_word_embeddings"):
            loaded.add("lm_head.weight")
        return loaded


def checkpoint_weights(tensors: Dict[str, torch.Tensor]) -> Iterator[Tuple[str, torch.Tensor]]:
    return iter(sorted(tensors.items()))


@contextlib.contextmanager
def distributed(tp_size: int, rank: int, port: int) -> Iterator[Any]:
    """vLLM's parallel state over gloo for one rank, and a CPU VllmConfig made current;
    yields the VllmConfig."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: PLC0415
    from vllm.distributed import parallel_state  # noqa: PLC0415

    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(world_size=tp_size, rank=rank,
                                                    distributed_init_method=f"tcp://127.0.0.1:{port}",
                                                    local_rank=rank, backend="gloo")
        parallel_state.initialize_model_parallel(tp_size, 1)
        try:
            yield vllm_config
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
